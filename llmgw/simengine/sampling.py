"""Deterministic "sampling": the tokens a request will emit, decided when it arrives.

The simulator has no model, so it draws output tokens from its word pieces
with a PRNG seeded by (seed, prompt): the same prompt and seed always give the
same completion, different prompts give different ones, and temperature 0
ignores the seed (greedy decoding has no randomness to seed). Everything is
decided up front, stop strings and stop token ids included, because the
scheduler must know the tokens that fill decode blocks (they are hashed and
announced like prompt blocks) and because it keeps the per-token hot path to
a list lookup. "Up front" never means more than will be emitted: with stops
the draw goes in chunks and ends at the first stop.

Length: with `max_tokens` (at most `room`, which the engine checks first)
the request emits exactly that many tokens unless a stop matches (as with
vLLM's ignore_eos; benchmarks need predictable lengths); without it a
"natural" length of 16-256 tokens is drawn, capped by the room left in
max_model_len.

Must NOT do I/O or know about HTTP.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw.simengine.tokenizer import EngineTokenizer

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
    def __init__(self, tokenizer: EngineTokenizer, *, default_seed: int = 0) -> None:
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
            if max_tokens > room:
                # The engine refuses this before calling (vLLM's 400); drawing it anyway would
                # materialise an output that can never be generated (1e9 tokens: 23.5 GB).
                raise ValueError(f"max_tokens={max_tokens} exceeds the room left ({room})")
            count = max_tokens
            finish = "length"
        if count < 1:
            return SampledOutput((), (), "length", None)
        piece = self._piece
        if not stop and not stop_token_ids:
            token_ids = rng.choices(self._pool, k=count)
            return SampledOutput(
                tuple(token_ids), tuple([piece[t] for t in token_ids]), finish, None
            )
        return self._sample_until_stop(rng, count, finish, stop, stop_token_ids)

    def _sample_until_stop(
        self,
        rng: random.Random,
        count: int,
        finish: Literal["stop", "length"],
        stop: Sequence[str],
        stop_token_ids: Sequence[int],
    ) -> SampledOutput:
        """Draw in growing chunks and end at the first stop, as vLLM checks after each token.

        Drawing all `count` tokens first and cutting afterwards would materialise an output
        up to max_model_len long for a request that stops after three tokens. Chunked draws
        give the same tokens (`choices` without weights draws one random() per token), and
        the first stop to *complete* wins, as in vLLM: a stop token id, or a stop string
        whose end falls before it (the cut is at the string's start).
        """
        pool = self._pool
        piece = self._piece
        stop_ids = set(stop_token_ids)
        token_ids: list[int] = []
        deltas: list[str] = []
        text = ""
        chunk = 64
        while len(token_ids) < count:
            new = rng.choices(pool, k=min(chunk, count - len(token_ids)))
            chunk = min(chunk * 2, 4096)
            stop_at = next((i for i, t in enumerate(new) if t in stop_ids), -1) if stop_ids else -1
            fresh = new if stop_at < 0 else new[:stop_at]
            before = len(text)
            token_ids += fresh
            deltas += [piece[t] for t in fresh]
            text += "".join(deltas[len(deltas) - len(fresh) :])
            if stop:
                # An occurrence not found last time must end in the new text; the stop that
                # ends first is the one vLLM would have stopped on.
                hits = [
                    (pos + len(s), pos, s)
                    for s in stop
                    if (pos := text.find(s, max(0, before - len(s) + 1))) >= 0
                ]
                if hits:
                    _, cut, matched = min(hits)
                    return _cut_at_stop_string(token_ids, deltas, text, cut, matched)
            if stop_at >= 0:
                token_ids.append(new[stop_at])
                deltas.append("")  # a stop token's text is not part of the output
                return SampledOutput(tuple(token_ids), tuple(deltas), "stop", new[stop_at])
        return SampledOutput(tuple(token_ids), tuple(deltas), finish, None)

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


def _cut_at_stop_string(
    token_ids: list[int], deltas: list[str], text: str, cut: int, matched: str
) -> SampledOutput:
    """End on the token that completes `matched`; the text stops where `matched` starts."""
    end_of_stop = cut + len(matched)
    clipped: list[str] = []
    start = 0
    for index, delta in enumerate(deltas):
        end = start + len(delta)
        clipped.append(text[min(start, cut) : min(end, cut)])
        if end >= end_of_stop:
            del token_ids[index + 1 :]
            break
        start = end
    return SampledOutput(tuple(token_ids), tuple(clipped), "stop", matched)
