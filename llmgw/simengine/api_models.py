"""Request bodies of the simulator's HTTP API (OpenAI and vLLM shapes), validated once per request.

Unknown fields are accepted and ignored, as vLLM and OpenAI do (clients send
`top_p`, `user`, `logit_bias`...). `cache_salt` is vLLM's extension: it is
hashed into the first block so tenants never share cached prefixes.

Must NOT hold engine logic; only shapes and the checks a shape can make.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    temperature: float | None = None
    n: int | None = 1
    cache_salt: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy completions default: 16 tokens when max_tokens is absent.
    max_tokens: int | None = 16
    echo: bool | None = False
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's chat default: the template already carries the special tokens. Honoured here as in
    # /tokenize, so a router that tokenizes with the same flag gets the tokens that are cached.
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)
