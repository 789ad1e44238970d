"""Deterministic "sampling": the tokens a request will emit, decided when it arrives.

The simulator has no model, so it draws output tokens from its word pieces
with a PRNG seeded by (seed, prompt): the same prompt and seed always give the
same completion, different prompts give different ones, and temperature 0
ignores the seed (greedy decoding has no randomness to seed). Everything is
decided up front, stop strings and stop token ids included, because the
scheduler must know the tokens that fill decode blocks (they are hashed and
announced like prompt blocks) and because it keeps the per-token hot path to
a list lookup.

Length: with `max_tokens` the request emits exactly that many tokens unless
a stop matches (as with vLLM's ignore_eos; benchmarks need predictable
lengths); without it a "natural" length of 16-256 tokens is drawn, capped by
the room left in max_model_len.

Must NOT do I/O or know about HTTP.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw.simengine.tokenizer import Tokenizer

__all__ = ["SampledOutput", "Sampler"]

_NATURAL_MIN = 16
_NATURAL_MAX = 256


@dataclass(frozen=True, slots=True)
class SampledOutput:
    token_ids: tuple[int, ...]
    # The text each token adds, in order; their concatenation is the completion text
    # (a matched stop string and anything after it already cut away).
    deltas: tuple[str, ...]
    finish_reason: Literal["stop", "length"]
    # vLLM's stop_reason: the stop string or token id that ended it, None for EOS or length.
    stop_reason: str | int | None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


class Sampler:
    def __init__(self, tokenizer: Tokenizer, *, default_seed: int = 0) -> None:
        self._tokenizer = tokenizer
        self._default_seed = default_seed
        self._pool = list(tokenizer.word_piece_ids())
        self._piece = {token_id: tokenizer.piece(token_id) for token_id in self._pool}

    def sample(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None,
        room: int,
        seed: int | None = None,
        temperature: float | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> SampledOutput:
        """`room` is max_model_len minus the prompt: what a missing max_tokens may use."""
        rng = random.Random(self._seed_material(prompt_token_ids, seed, temperature))
        if max_tokens is None:
            natural = rng.randint(_NATURAL_MIN, _NATURAL_MAX)
            count = max(min(natural, room), 1)
            finish: Literal["stop", "length"] = "stop" if natural <= room else "length"
        else:
            count = max_tokens
            finish = "length"
        if count < 1:
            return SampledOutput((), (), "length", None)
        token_ids = rng.choices(self._pool, k=count)
        piece = self._piece
        stop_reason: str | int | None = None
        if stop_token_ids:
            stops = set(stop_token_ids)
            for index, token_id in enumerate(token_ids):
                if token_id in stops:
                    del token_ids[index + 1 :]
                    deltas = [piece[t] for t in token_ids[:-1]] + [""]
                    return SampledOutput(tuple(token_ids), tuple(deltas), "stop", token_id)
        deltas = [piece[t] for t in token_ids]
        if stop:
            text = "".join(deltas)
            hits = [(pos, s) for s in stop if s and (pos := text.find(s)) >= 0]
            if hits:
                cut, stop_reason = min(hits)
                end_of_stop = cut + len(str(stop_reason))
                clipped: list[str] = []
                start = 0
                for index, delta in enumerate(deltas):
                    end = start + len(delta)
                    clipped.append(text[min(start, cut) : min(end, cut)])
                    if end >= end_of_stop:
                        del token_ids[index + 1 :]
                        break
                    start = end
                return SampledOutput(tuple(token_ids), tuple(clipped), "stop", stop_reason)
        return SampledOutput(tuple(token_ids), tuple(deltas), finish, stop_reason)

    def _seed_material(
        self, prompt_token_ids: Sequence[int], seed: int | None, temperature: float | None
    ) -> int:
        if temperature == 0:
            seed_part = b"greedy"
        else:
            seed_part = str(self._default_seed if seed is None else seed).encode()
        digest = hashlib.blake2b(
            seed_part + b"|" + array("q", prompt_token_ids).tobytes(), digest_size=8
        ).digest()
        return int.from_bytes(digest, "big")
