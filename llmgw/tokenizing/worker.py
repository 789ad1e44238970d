"""A tokenizing worker process: ``python -m llmgw.tokenizing.worker [memory_base_bytes]``.

It reads requests from stdin and writes replies to stdout, one frame each (``protocol``), one
at a time, and holds the tokenizers it was sent by their files' digest. Every render is within
``kv.template_budget`` (steps, characters), and the process's address space is capped (the
soft ``RLIMIT_AS``: a base plus 16 times the most tokenizer files it held at once, what a
loaded tokenizer.json takes at most), so what the budget misses ends in a ``MemoryError`` here, never
in the OOM killer's choice. The parent bounds the time (``pool``: a call past its deadline has
this process killed).

Every failure is a reply, whatever it is (``BaseException`` but the interpreter's own exits): a
Rust panic from ``tokenizers`` (``PanicException``), a ``ZeroDivisionError`` in a template, a
``MemoryError``; after a ``MemoryError`` the process exits once it replied (its heap may be in
any state) and the parent starts another.
"""

from __future__ import annotations

import array
import os
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO, Final

from llmgw.errors import SpecError, clip
from llmgw.kv.hf_tokenizer import (
    DEFAULT_MAX_RENDERED_CHARS,
    HfTokenizer,
    TokenizerFiles,
    TokenizerFilesError,
)
from llmgw.kv.template_budget import TemplateBudgetError
from llmgw.tokenizing.protocol import HEADER_BYTES, decode, encode, frame, frame_length

__all__ = ["Worker", "main"]

_MEMORY_PER_FILE_BYTE: Final = 16
# What an upload is tried with: a plain chat, and one with a system turn and an answer (a
# template may refuse the system role: that is the engine's refusal too, not a failure).
_SAMPLE_CHATS: Final = (
    [{"role": "user", "content": "Hello! What is 12 * 7? ünïcödé ✓"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a prime number."},
    ],
)
_SAMPLE_TEXT: Final = "The quick brown fox, 1234567890; zqxjv ünïcödé ✓ 你好 \n\t<tag>"


def _failed(kind: str, exc: BaseException | str) -> dict[str, Any]:
    error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {clip(str(exc))}"
    return {"ok": False, "kind": kind, "error": error}


class Worker:
    """The worker's state: the tokenizers held, and the address-space cap they add up to."""

    def __init__(self, memory_base: int | None) -> None:
        self._held: dict[str, HfTokenizer] = {}
        self._sizes: dict[str, int] = {}
        self._memory_base = memory_base
        self._cap = 0
        self.exit_after_reply = False

    def _cap_memory(self, extra: int = 0) -> None:
        if self._memory_base is None:
            return
        import resource

        held = sum(self._sizes.values()) + extra
        # Never lowered: what a dropped (or failed) tokenizer held may stay in the address
        # space, and a cap under the space in use fails the next allocation; the next load
        # reuses that room. The cap is the base plus the most ever held at once.
        soft = self._cap = max(self._cap, self._memory_base + _MEMORY_PER_FILE_BYTE * held)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "tokenize":
                return self._tokenize(request)
            if op == "load":
                return self._load(request)
            if op == "drop":
                self._held.pop(str(request.get("digest")), None)
                self._sizes.pop(str(request.get("digest")), None)
                self._cap_memory()
                return {"ok": True}
            if op == "check":
                return self._check(request)
            if op == "ping":
                return {"ok": True}
            return _failed("failed", f"unknown op {clip(str(op))!r}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except MemoryError as exc:
            self.exit_after_reply = True
            return _failed("failed", exc)
        except BaseException as exc:  # a Rust panic is a BaseException: a reply all the same
            return _failed("failed", exc)

    def _files(self, request: Mapping[str, Any]) -> TokenizerFiles:
        raw = request.get("files")
        if not isinstance(raw, dict):
            raise TokenizerFilesError("no files")
        return TokenizerFiles({str(k): bytes(v) for k, v in raw.items()})

    def _loaded(self, request: Mapping[str, Any]) -> tuple[HfTokenizer, int]:
        """The request's files as a tokenizer, and their size: the cap raised for them first."""
        files = self._files(request)
        size = sum(len(v) for v in files.files.values())
        self._cap_memory(size)
        return HfTokenizer(files), size

    def _load(self, request: Mapping[str, Any]) -> dict[str, Any]:
        try:
            tokenizer, size = self._loaded(request)
        except TokenizerFilesError as exc:
            return _failed("files", exc.message)
        digest = str(request.get("digest") or tokenizer.digest)
        self._held[digest] = tokenizer
        self._sizes[digest] = size
        return {"ok": True, "segment_cached": tokenizer.segment_cached}

    def _tokenize(self, request: Mapping[str, Any]) -> dict[str, Any]:
        tokenizer = self._held.get(str(request.get("digest")))
        if tokenizer is None:
            return _failed("unknown", "this worker does not hold that tokenizer")
        body = request.get("body")
        if not isinstance(body, dict):
            return _failed("unsupported", "no body")
        max_chars = int(request.get("max_chars") or 0) or DEFAULT_MAX_RENDERED_CHARS
        try:
            rendered = tokenizer.render_request(
                body, chat=bool(request.get("chat")), max_chars=max_chars
            )
        except TemplateBudgetError as exc:
            kind = "too_long" if exc.what == "output" else "failed"
            return _failed(kind, f"TemplateBudgetError: {exc.message}")
        except (SpecError, RecursionError) as exc:
            # The body's (a content the template cannot add, a deep value: the renderer's
            # SpecError): the engine refuses it too, and says why.
            return _failed("refused", exc)
        if rendered is None:
            return _failed("unsupported", "a body this cannot tokenize")
        text, special = rendered
        ids = tokenizer.encode(text, add_special_tokens=special)
        return {"ok": True, "ids": array.array("I", ids).tobytes(), "chars": len(text)}

    def _check(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Load the files and try them as a gateway would, keeping nothing."""
        try:
            tokenizer, _ = self._loaded(request)
        except TokenizerFilesError as exc:
            return _failed("files", exc.message)
        max_chars = int(request.get("max_chars") or 1_000_000)
        texts = [_SAMPLE_TEXT]
        if tokenizer.has_chat_template:
            for chat in _SAMPLE_CHATS:
                try:
                    texts.append(tokenizer.render_chat(chat, max_chars=max_chars))
                except TemplateBudgetError as exc:
                    return _failed("failed", f"the chat template: {exc.message}")
                except SpecError:
                    continue  # refused as the engine would (a system role it has not)
        for text in texts:
            for special in (False, True):
                tokenizer.encode(text, add_special_tokens=special)
        return {"ok": True, "segment_cached": tokenizer.segment_cached}


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    parts: list[bytes] = []
    while n:
        got = stream.read(n)
        if not got:
            return None
        parts.append(got)
        n -= len(got)
    return b"".join(parts)


def serve(inp: BinaryIO, out: BinaryIO, worker: Worker) -> None:
    while True:
        header = _read_exactly(inp, HEADER_BYTES)
        if header is None:
            return
        payload = _read_exactly(inp, frame_length(header))
        if payload is None:
            return
        try:
            reply = worker.handle(decode(payload))
        except ValueError as exc:
            reply = _failed("failed", exc)
        out.write(frame(encode(reply)))
        out.flush()
        if worker.exit_after_reply:
            return


def main(argv: list[str]) -> None:
    # stdout is the channel: whatever else would write to it (Python or a library's own code)
    # goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    memory_base = int(argv[1]) if len(argv) > 1 else None
    worker = Worker(memory_base)
    worker._cap_memory()
    serve(sys.stdin.buffer, out, worker)


if __name__ == "__main__":
    main(sys.argv)
