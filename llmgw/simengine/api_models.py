"""Request bodies of the simulator's HTTP API (OpenAI and vLLM shapes), validated once per request.

Unknown fields are accepted and ignored, as vLLM and OpenAI do (clients send
`top_p`, `user`, `logit_bias`...). `cache_salt` is vLLM's extension: it is
hashed into the first block so tenants never share cached prefixes.

Sampling parameters are checked as vLLM's SamplingParams and protocol
models check them (`check()`), with the offending field as the error's
`param`: vLLM would answer these 400, and a gateway that retries or reports
must see the same answer from the simulator. The simulator samples none of
them but temperature and seed; the others are validated and ignored.

Must NOT hold engine logic; only shapes and the checks a shape can make.
"""

from __future__ import annotations

import math
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from llmgw.errors import SpecError

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
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


# vLLM takes the seed as a torch.long: a larger one is a 400 there, and here it would be hashed
# as an arbitrarily long decimal string.
_SEED_MIN: Final = -(2**63)
_SEED_MAX: Final = 2**63 - 1
# vLLM's default --max-logprobs (and OpenAI's top_logprobs maximum).
MAX_LOGPROBS: Final = 20
# vLLM sets no limit; OpenAI allows 4. Each stop string is searched for in the output, so the
# count is the simulator's cost per token: bounded generously, not to OpenAI's 4.
MAX_STOP_STRINGS: Final = 64
MAX_STOP_TOKEN_IDS: Final = 1024


def _finite(name: str, value: float | None) -> None:
    # JSON has no NaN/Infinity, but 1e999 parses to inf: every range check below must see a number.
    if value is not None and not math.isfinite(value):
        raise SpecError(f"{name}={value} is not a finite number", field=name)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    n: int | None = 1
    cache_salt: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check(self) -> None:
        """vLLM's SamplingParams rules (0.10-0.11 wording), each naming its field."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            _finite(name, getattr(self, name))
        if self.n is not None and self.n < 1:
            raise SpecError(f"n must be at least 1, got {self.n}.", field="n")
        if self.temperature is not None and self.temperature < 0:
            raise SpecError(
                f"temperature must be non-negative, got {self.temperature}.", field="temperature"
            )
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise SpecError(f"top_p must be in (0, 1], got {self.top_p}.", field="top_p")
        if self.top_k is not None and self.top_k < -1:
            raise SpecError(
                f"top_k must be 0 (disable), or at least 1, got {self.top_k}.", field="top_k"
            )
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise SpecError(f"min_p must be in [0, 1], got {self.min_p}.", field="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2 <= value <= 2:
                raise SpecError(f"{name} must be in [-2, 2], got {value}.", field=name)
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise SpecError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                field="repetition_penalty",
            )
        if self.min_tokens is not None and self.min_tokens < 0:
            raise SpecError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                field="min_tokens",
            )
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise SpecError(
                f"seed={self.seed} is outside the 64-bit signed range "
                f"[{_SEED_MIN}, {_SEED_MAX}]; send a smaller seed",
                field="seed",
            )
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise SpecError(
                f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted",
                field="stop",
            )
        if any(not s for s in stops):
            raise SpecError("stop cannot contain an empty string.", field="stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SpecError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} are accepted",
                field="stop_token_ids",
            )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy completions default: 16 tokens when max_tokens is absent.
    max_tokens: int | None = 16
    echo: bool | None = False
    add_special_tokens: bool = True
    logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SpecError(
                f"logprobs={self.logprobs}: must be between 0 and {MAX_LOGPROBS} "
                "(vLLM's default --max-logprobs)",
                field="logprobs",
            )


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
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        top = self.top_logprobs
        if top is not None:
            if not 0 <= top <= MAX_LOGPROBS:
                raise SpecError(
                    f"top_logprobs={top}: must be between 0 and {MAX_LOGPROBS}",
                    field="top_logprobs",
                )
            if top > 0 and not self.logprobs:
                raise SpecError(
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                    field="top_logprobs",
                )


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
