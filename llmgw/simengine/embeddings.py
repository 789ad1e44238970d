"""`/v1/embeddings` in the simulator: deterministic pseudo-embeddings of the input's tokens.

The simulator has no model, so a text's embedding is built by feature hashing its tokens: each
distinct token adds `1 + log(count)` to a few coordinates picked (with a sign) by a hash of its
id, and the sum is L2-normalised. The same tokens always give the same vector in every process,
and texts that share tokens point in similar directions, so a RAG demo's nearest neighbours
are not noise. It behaves as a Matryoshka model of `EMBEDDING_SIZE` dimensions: `dimensions`
keeps the first coordinates and normalises again; each token's probes land in nested leading
ranges (all 384 coordinates, the first 96, 24, 6, then the first), so every prefix, however
short, still carries every token.

Shapes follow vLLM 0.32's pooling server (vllm/entrypoints/pooling/embed/protocol.py and
serving.py, pooling/utils.py get_pooling_usage): `input` as a string, strings, token ids or
lists of them; `encoding_format` float or base64 (float32 in native byte order, as vLLM and the
openai client's decoder use); usage counts prompt tokens only; the `dimensions` errors are
pooling_params.py's. Where it differs: at most `MAX_INPUTS` inputs per request (OpenAI's own
limit; vLLM sets none, and the simulator must not be what one request can freeze), and
`bytes`/`bytes_only` encodings are refused.

A pooling engine keeps no prefix cache worth routing to, so embeddings bypass the generation
scheduler: no blocks, no KV events. The shell models their cost as one prefill step.

Must NOT touch the engine or sockets (api_routes.py does).
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from llmgw.errors import SpecError, clip

__all__ = [
    "EMBEDDING_SIZE",
    "MAX_INPUTS",
    "EmbeddingsRequest",
    "embedding",
    "embeddings_object",
    "encode_embedding",
    "too_long_error",
]

EMBEDDING_SIZE: Final = 384
MAX_INPUTS: Final = 2048
# The ranges [0, n) a distinct token's probes land in: one probe anywhere, then ever shorter
# leading ranges, so a short `dimensions` prefix never loses a token (with one probe over
# all 384, the first 4 coordinates held nothing for most short texts).
_PROBE_RANGES: Final = (EMBEDDING_SIZE, 96, 24, 6, 1)
_MASK64: Final = (1 << 64) - 1
_ENCODINGS: Final = ("float", "base64")


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True

    def check(self, served_model: str) -> None:
        if self.encoding_format not in _ENCODINGS:
            raise SpecError(
                f"encoding_format={clip(self.encoding_format)!r} is not served by the "
                f"simulator; send one of {', '.join(_ENCODINGS)}",
                field="encoding_format",
            )
        if self.dimensions is not None and not 1 <= self.dimensions <= EMBEDDING_SIZE:
            # pooling_params.py's wording.
            raise SpecError(
                f"Model {served_model!r} only supports dimensions in range "
                f"[1, {EMBEDDING_SIZE}], got {self.dimensions}.",
                field="dimensions",
            )
        if isinstance(self.input, list) and len(self.input) > MAX_INPUTS:
            raise SpecError(
                f"input has {len(self.input)} items; at most {MAX_INPUTS} are embedded per "
                "request: split it into several requests",
                field="input",
            )

    def prompts(self) -> list[str | list[int]]:
        """Each input to embed: a text or a token-id list."""
        if isinstance(self.input, str):
            return [self.input]
        # Validation made the list one kind: ids of one prompt, or several prompts.
        ids: list[int] = []
        prompts: list[str | list[int]] = []
        for item in self.input:
            if isinstance(item, int):
                ids.append(item)
            else:
                prompts.append(item)
        return [ids] if ids else prompts


def too_long_error(max_model_len: int, num_tokens: int, index: int) -> SpecError:
    """vLLM's refusal of a prompt over the context (renderers/params.py _token_len_check)."""
    return SpecError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"(input[{index}]) contains {num_tokens} input tokens, which exceeds this limit even "
        "without any output tokens. Please reduce the length of the input prompt.",
        field="input",
    )


def _mix(value: int) -> int:
    """splitmix64's finaliser: consecutive token ids land on unrelated coordinates."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def embedding(token_ids: Sequence[int], dimensions: int | None = None) -> list[float]:
    """The unit vector for these tokens, rounded to float32 (what a model would return)."""
    vector = [0.0] * EMBEDDING_SIZE
    # Counting first bounds the Python loop by the distinct tokens (at most the vocabulary),
    # not by the prompt's length.
    for token, count in Counter(token_ids).items():
        weight = 1.0 + math.log(count)
        first = _mix(token)
        bits = (first << 64) | _mix(first)
        for probe, span in enumerate(_PROBE_RANGES):
            chunk = (bits >> (24 * probe)) & 0xFFFFFF
            vector[(chunk >> 1) % span] += -weight if chunk & 1 else weight
    if dimensions is not None:
        del vector[dimensions:]
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if norm == 0.0:
        # Only when every probe cancelled out: a fixed unit vector keeps the answer
        # normalised and deterministic.
        vector = [0.0] * len(vector)
        vector[0] = 1.0
        norm = 1.0
    return list(array("f", (x / norm for x in vector)))


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(array("f", vector).tobytes()).decode("ascii")
    return vector


def embeddings_object(
    model: str, vectors: Sequence[list[float] | str], num_prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's EmbeddingResponse, its UsageInfo dumped whole."""
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": vector}
            for i, vector in enumerate(vectors)
        ],
        "usage": {
            "prompt_tokens": num_prompt_tokens,
            "total_tokens": num_prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
