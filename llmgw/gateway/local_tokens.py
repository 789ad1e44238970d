"""Tokenizing in the gateway, from each model's own tokenizer files, verified against the engine.

Precise routing needs the prompt's token ids. Asking a replica's ``/tokenize`` costs a round
trip to a busy engine on every request (the timeouts under load were where precise routing
lost its hits), so the gateway tokenizes itself (``llmgw.kv.hf_tokenizer``, the files the
agent shipped from the model's directory, or the profile named) and the replica's
``/tokenize`` is the fallback.

- Off the event loop where it costs: the template is rendered on the loop (string building,
  microseconds), and a prompt whose pieces are cached but for at most ``inline_chars``
  characters (a chat's new turn after its cached system prompt) is encoded there too, in well
  under a millisecond: a hop to a thread and back costs more than that on a busy loop (the
  bench measured 5-10 ms p50 through the pool on two loaded cores). The rest goes to a small
  thread pool (``tokenizers`` releases the GIL while it encodes), bounded: a prompt longer than ``max_chars`` is not tokenized here, a call past
  ``timeout_s`` is abandoned (the request falls back), and more than ``workers * 4`` calls
  waiting are refused ("busy") instead of queued behind each other.
- Never silently wrong: the first ``verify_first`` requests of a model, then one in
  ``verify_every``, are also tokenized by a replica, off the request path; a difference turns
  local tokenizing off for that model's files (``mode`` "remote"; a counted, logged mismatch
  with both token counts). New files (another digest) are tried again.
- Kept while Postgres is down: what is loaded stays loaded; only new files need the store.

``mode(model)``: "local" (tokenized here) or "remote" (the replica's /tokenize: no usable
files, ``tokenizer: none``, or a mismatch); ``tokens``, which decides where a prompt's ids come
from, reports "none" for a model precise routing does not tokenize at all (no replica hashes
KV events).
What it must NOT do: block the loop, or raise into the request path (every failure is a
reason the caller counts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from llmgw.errors import LlmgwError
from llmgw.kv.hf_tokenizer import HfTokenizer, TokenizerFiles
from llmgw.logs import get_logger

__all__ = ["MODES", "LocalTokenizers", "Mode", "Verdict"]

log = get_logger("llmgw.gateway")

Mode = Literal["local", "remote", "none"]
MODES: tuple[Mode, ...] = ("local", "remote", "none")


@dataclass(frozen=True, slots=True)
class Verdict:
    """One verification's result, for the metric and the log."""

    model: str
    digest: str
    match: bool
    local_tokens: int
    remote_tokens: int
    first_difference: int | None


@dataclass
class _Model:
    digest: str
    tokenizer: HfTokenizer | None = None  # None while loading, or when the files failed
    disabled: str | None = None  # why local tokenizing is off for these files
    requests: int = 0


class LocalTokenizers:
    """Per model, the tokenizer its files make, and whether it may be trusted."""

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout_s: float = 0.05,
        max_chars: int = 1_000_000,
        verify_first: int = 8,
        verify_every: int = 100,
        inline_chars: int = 2048,
    ) -> None:
        self._inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._max_waiting = workers * 4
        self._waiting = 0
        self._timeout_s = timeout_s
        self._max_chars = max_chars
        self._verify_first = verify_first
        self._verify_every = max(1, verify_every)
        self._models: dict[str, _Model] = {}
        self._seen: Mapping[str, TokenizerFiles] | None = None
        self._loads: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- files -------------------------------------------------------------------------------

    def sync(self, files: Mapping[str, TokenizerFiles]) -> None:
        """Take the models' files as they stand (model -> files). Loads what is new off the
        loop; a model whose files did not change keeps its state (and its verdict); a model no
        longer listed keeps what it loaded (fail static: the store may be down)."""
        if files is self._seen:
            return
        self._seen = files
        for model, got in files.items():
            current = self._models.get(model)
            if current is not None and current.digest == got.digest:
                continue
            entry = _Model(got.digest)
            if current is None or current.tokenizer is None:
                self._models[model] = entry
            task = asyncio.get_running_loop().create_task(self._load(model, entry, got))
            self._loads.add(task)
            task.add_done_callback(self._loads.discard)

    async def _load(self, model: str, entry: _Model, files: TokenizerFiles) -> None:
        loop = asyncio.get_running_loop()
        try:
            entry.tokenizer = await loop.run_in_executor(self._pool, HfTokenizer, files)
        except LlmgwError as exc:
            entry.disabled = exc.message
            log.warning("gateway_tokenizer_unusable", model=model, digest=files.digest,
                        error=exc.message)  # fmt: skip
        except Exception as exc:  # a tokenizer.json the library chokes on: never the loop's end
            entry.disabled = repr(exc)
            log.warning("gateway_tokenizer_unusable", model=model, digest=files.digest,
                        error=repr(exc))  # fmt: skip
        # Swapped in only once loaded: requests keep the old files' tokenizer meanwhile.
        self._models[model] = entry
        if entry.tokenizer is not None:
            log.info("gateway_tokenizer_loaded", model=model, digest=files.digest,
                     segment_cached=entry.tokenizer.segment_cached)  # fmt: skip

    async def settled(self) -> None:
        """Until every load started so far has finished (tests, and the bench's warm-up)."""
        while self._loads:
            await asyncio.gather(*list(self._loads), return_exceptions=True)

    # --- state -------------------------------------------------------------------------------

    def mode(self, model: str) -> Mode:
        entry = self._models.get(model)
        if entry is None or entry.tokenizer is None or entry.disabled is not None:
            return "remote"
        return "local"

    def digest(self, model: str) -> str | None:
        entry = self._models.get(model)
        return entry.digest if entry is not None else None

    def models(self) -> list[str]:
        return sorted(self._models)

    def disabled_reason(self, model: str) -> str | None:
        entry = self._models.get(model)
        return entry.disabled if entry is not None else None

    # --- tokenizing --------------------------------------------------------------------------

    async def tokenize(
        self, model: str, body: Mapping[str, Any], *, chat: bool, chars: int
    ) -> tuple[list[int], bool] | str:
        """(the ids, whether to verify them) or why not: "unavailable", "too_long",
        "busy", "timeout", "refused" (the template or tokenizer refused the body; the
        engine will say why) or "unsupported" (a body this cannot tokenize)."""
        entry = self._models.get(model)
        if entry is None or entry.tokenizer is None or entry.disabled is not None:
            return "unavailable"
        if chars > self._max_chars:
            return "too_long"
        if self._waiting >= self._max_waiting:
            return "busy"
        tokenizer = entry.tokenizer
        try:
            rendered = tokenizer.render_request(body, chat=chat)
        except (LlmgwError, RecursionError, ValueError, TypeError):
            return "refused"  # the engine will refuse it too, and say why
        if rendered is None:
            return "unsupported"
        text, special = rendered
        got: list[int] | str
        if tokenizer.uncached_chars(text) <= self._inline_chars:
            got = _encode(tokenizer, text, special)
        else:
            self._waiting += 1
            loop = asyncio.get_running_loop()
            try:
                future = loop.run_in_executor(self._pool, _encode, tokenizer, text, special)
                got = await asyncio.wait_for(future, self._timeout_s)
            except TimeoutError:
                return "timeout"
            finally:
                self._waiting -= 1
        if isinstance(got, str):
            return got
        entry.requests += 1
        n = entry.requests
        verify = n <= self._verify_first or n % self._verify_every == 0
        return got, verify

    def verify(
        self,
        model: str,
        local: list[int],
        remote: Callable[[], Awaitable[list[int] | str]],
        on_verdict: Callable[[Verdict], None],
    ) -> None:
        """Compare ``local`` with what ``remote`` (a replica's /tokenize) gives, in a task of
        its own; a difference disables these files' tokenizer."""
        entry = self._models.get(model)
        if entry is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._verify(model, entry, local, remote, on_verdict)
        )
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _verify(
        self,
        model: str,
        entry: _Model,
        local: list[int],
        remote: Callable[[], Awaitable[list[int] | str]],
        on_verdict: Callable[[Verdict], None],
    ) -> None:
        got = await remote()
        if isinstance(got, str):
            return  # the replica could not say (busy, timeout): asked again on a later sample
        match = got == local
        first = None
        if not match:
            first = next(
                (i for i, (a, b) in enumerate(zip(local, got, strict=False)) if a != b),
                min(len(local), len(got)),
            )
            if entry.disabled is None:
                entry.disabled = (
                    f"local tokens differ from the engine's /tokenize ({len(local)} vs "
                    f"{len(got)} tokens, first difference at {first})"
                )
            log.warning(
                "gateway_tokenizer_mismatch",
                model=model,
                digest=entry.digest,
                local_tokens=len(local),
                remote_tokens=len(got),
                first_difference=first,
            )
        on_verdict(Verdict(model, entry.digest, match, len(local), len(got), first))


def _encode(tokenizer: HfTokenizer, text: str, special: bool) -> list[int] | str:
    """The text's ids, or why not (on the loop, or on a pool thread)."""
    try:
        return tokenizer.encode(text, add_special_tokens=special)
    except (ValueError, TypeError):
        return "refused"
