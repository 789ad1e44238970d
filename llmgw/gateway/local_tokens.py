"""Tokenizing in the gateway, from each model's own tokenizer files, verified against the engine.

Precise routing needs the prompt's token ids. Asking a replica's ``/tokenize`` costs a round
trip to a busy engine on every request (the timeouts under load were where precise routing
lost its hits), so the gateway tokenizes itself (``llmgw.kv.hf_tokenizer``, the files the
agent shipped from the model's directory, or the profile named) and the replica's
``/tokenize`` is the fallback.

- Never on the event loop: the template is rendered and the text encoded in worker processes
  (``llmgw.tokenizing.pool``: ``tokenizers`` holds the GIL while it encodes and a template
  renders in Python, so threads did not protect the loop: 160,000 empty messages stalled it
  ~3 s). The request waits at most ``timeout_s`` (then it falls back; the worker finishes and
  its pieces stay cached); a worker past ``deadline_s`` is killed and replaced. More than
  ``workers * 4`` calls waiting for a worker are refused ("busy"), never queued.
- Bounded before any work: a prompt whose own text is over ``max_chars`` is not sent, and one
  that renders to more ("too_long") stops rendering there; the caller refuses both (a 400).
  Every render is within the template budget (``kv.template_budget``).
- Failures fall back, and count: anything the tokenizer or the template raises (a Rust panic,
  a ``ZeroDivisionError``, a template over its step budget, a worker killed past its deadline
  or dead) is "failed" for the request (the caller asks a replica) and
  ``failing_after`` of them in a row turn local tokenizing off for those files (``disabled``:
  "failing: <the last error>"). A body the engine refuses too ("refused") is not the
  tokenizer's fault and never counts.
- Never silently wrong: the first ``verify_first`` requests of a model, then one in
  ``verify_every``, are also tokenized by a replica, off the request path; a difference turns
  local tokenizing off for that model's files (``mode`` "remote"; a counted, logged mismatch
  with both token counts). New files (another digest) are tried again.
- Kept while Postgres is down: what is loaded stays loaded; only new files need the store.

``mode(model)``: "local" (tokenized here) or "remote" (the replica's /tokenize: no usable
files, ``tokenizer: none``, a mismatch, or failing); ``tokens``, which decides where a prompt's
ids come from, reports "none" for a model precise routing does not tokenize at all (no replica
hashes KV events).
What it must NOT do: block the loop, or raise into the request path (every failure is a
reason the caller counts).
"""

from __future__ import annotations

import array
import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from llmgw.errors import clip
from llmgw.kv.hf_tokenizer import TokenizerFiles
from llmgw.logs import get_logger
from llmgw.tokenizing.pool import WorkerPool

__all__ = ["MODES", "LocalTokenizers", "Mode", "Verdict"]

log = get_logger("llmgw.gateway")

Mode = Literal["local", "remote", "none"]
MODES: tuple[Mode, ...] = ("local", "remote", "none")

# Failures in a row that turn a model's files off: one is a body, five are the tokenizer.
FAILING_AFTER = 5
# A long prompt may wait longer for its ids than ``timeout_s``, a second per million characters
# it renders to (estimated): its prefill costs the engine far more, and only the answer can
# refuse it for its rendered length or the context length before it is sent. The loop is free
# meanwhile; the worker's deadline bounds it.
_WAIT_S_PER_CHAR = 1e-6


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
    ready: bool = False  # loaded by a worker
    disabled: str | None = None  # why local tokenizing is off for these files
    failing: str | None = None  # the short reason, when turned off by failures
    failures: int = 0  # in a row
    requests: int = 0


class LocalTokenizers:
    """Per model, the tokenizer its files make (held by the workers), and whether it may be
    trusted."""

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout_s: float = 0.05,
        max_chars: int = 1_000_000,
        verify_first: int = 8,
        verify_every: int = 100,
        deadline_s: float = 5.0,
        failing_after: int = FAILING_AFTER,
    ) -> None:
        self._pool = WorkerPool(workers=workers, deadline_s=deadline_s)
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self.max_chars = max_chars
        self._verify_first = verify_first
        self._verify_every = max(1, verify_every)
        self._failing_after = max(1, failing_after)
        self._models: dict[str, _Model] = {}
        self._seen: Mapping[str, TokenizerFiles] | None = None
        self._loads: set[asyncio.Task[None]] = set()
        self.on_disabled: Callable[[str], None] | None = None  # told the model's name

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def close(self) -> None:
        self._pool.close()

    # --- files -------------------------------------------------------------------------------

    def sync(self, files: Mapping[str, TokenizerFiles]) -> None:
        """Take the models' files as they stand (model -> files). Loads what is new in the
        workers; a model whose files did not change keeps its state (and its verdict); a model
        no longer listed keeps what it loaded (fail static: the store may be down)."""
        if files is self._seen:
            return
        self._seen = files
        for model, got in files.items():
            current = self._models.get(model)
            if current is not None and current.digest == got.digest:
                continue
            entry = _Model(got.digest)
            if current is None or not current.ready:
                self._models[model] = entry
            task = asyncio.get_running_loop().create_task(self._load(model, entry, got, current))
            self._loads.add(task)
            task.add_done_callback(self._loads.discard)

    async def _load(
        self, model: str, entry: _Model, files: TokenizerFiles, old: _Model | None
    ) -> None:
        error = await self._pool.load(files.digest, files.files)
        if error is None:
            entry.ready = True
            log.info("gateway_tokenizer_loaded", model=model, digest=files.digest)
        else:
            entry.disabled = error
            log.warning("gateway_tokenizer_unusable", model=model, digest=files.digest,
                        error=error)  # fmt: skip
        # Swapped in only once loaded: requests keep the old files' tokenizer meanwhile.
        self._models[model] = entry
        held = {m.digest for m in self._models.values()}
        if old is not None and old.digest not in held:
            self._pool.drop(old.digest)

    async def settled(self) -> None:
        """Until every load started so far has finished (tests, and the bench's warm-up)."""
        while self._loads:
            await asyncio.gather(*list(self._loads), return_exceptions=True)

    # --- state -------------------------------------------------------------------------------

    def mode(self, model: str) -> Mode:
        entry = self._models.get(model)
        if entry is None or not entry.ready or entry.disabled is not None:
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

    def failing(self, model: str) -> str | None:
        """The short reason (an exception's type, "deadline", "crashed") where failures turned
        the model's files off; None otherwise."""
        entry = self._models.get(model)
        return entry.failing if entry is not None else None

    # --- tokenizing --------------------------------------------------------------------------

    async def tokenize(
        self, model: str, body: Mapping[str, Any], *, chat: bool, chars: int, rendered: int = 0
    ) -> tuple[list[int], bool] | str:
        """(the ids, whether to verify them) or why not: "unavailable", "too_long" (the
        prompt's text, or what it renders to, is over ``max_chars``), "busy", "timeout",
        "refused" (the template or tokenizer refused the body; the engine will say why),
        "unsupported" (a body this cannot tokenize) or "failed" (the tokenizer or the
        template failed: counted against the files). ``chars``: the prompt's own text;
        ``rendered``: an estimate of what it renders to (a longer wait for a longer one)."""
        entry = self._models.get(model)
        if entry is None or not entry.ready or entry.disabled is not None:
            return "unavailable"
        if chars > self.max_chars:
            return "too_long"
        request = {
            "op": "tokenize",
            "digest": entry.digest,
            "body": body,
            "chat": chat,
            "max_chars": self.max_chars,
        }
        got = await self._pool.call(
            request,
            digest=entry.digest,
            wait_s=min(self._deadline_s, self._timeout_s + max(chars, rendered) * _WAIT_S_PER_CHAR),
            on_done=lambda outcome: self._account(model, entry, outcome),
        )
        if isinstance(got, str):
            if got in ("busy", "timeout"):
                return got
            return "unsupported" if got == "unencodable" else "failed"
        if not got.get("ok"):
            kind = str(got.get("kind"))
            if kind in ("too_long", "refused", "unsupported"):
                return kind
            return "unavailable" if kind == "unknown" else "failed"
        ids = array.array("I")
        ids.frombytes(bytes(got["ids"]))
        entry.requests += 1
        n = entry.requests
        verify = n <= self._verify_first or n % self._verify_every == 0
        return ids.tolist(), verify

    def _account(self, model: str, entry: _Model, outcome: dict[str, Any] | str) -> None:
        """A run's outcome, whether or not its request still waited: a success clears the
        files' failures, a failure of the tokenizer's counts."""
        if isinstance(outcome, dict):
            if outcome.get("ok"):
                entry.failures = 0
                return
            if outcome.get("kind") != "failed":
                return  # the body's (refused, too long, unsupported), not the tokenizer's
            error = str(outcome.get("error", "failed"))
            short = error.partition(":")[0] or "failed"
        elif outcome in ("deadline", "crashed"):
            error = short = outcome
        else:
            return  # closed, or never ran
        entry.failures += 1
        log.warning("gateway_tokenizer_failed", model=model, digest=entry.digest,
                    error=clip(error), in_a_row=entry.failures)  # fmt: skip
        if entry.failures >= self._failing_after and entry.disabled is None:
            entry.failing = short
            entry.disabled = f"failing: {clip(error)} ({entry.failures} in a row)"
            log.warning("gateway_tokenizer_disabled", model=model, digest=entry.digest,
                        reason=entry.disabled)  # fmt: skip
            if self.on_disabled is not None:
                self.on_disabled(model)

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
