"""`llmgw kv ...`: what an operator reaches for when the router and vLLM disagree.

``llmgw kv hash`` hashes token ids (a JSON list on stdin) into vLLM's block hashes, one per full
block; ``llmgw kv decode`` turns a raw KV event payload (stdin) into JSON. The I/O shell around
``llmgw.kv``: it must NOT hash or parse itself, and reads no environment (the engine's
PYTHONHASHSEED is not this shell's: pass --seed).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

__all__ = ["app"]

app = typer.Typer(help="Inspect vLLM-compatible KV block hashes and events.", no_args_is_help=True)

_EXIT_INVALID = 2  # bad input on stdin, as for a usage error


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(_EXIT_INVALID)


@app.command("hash")
def hash_command(
    block_size: Annotated[int, typer.Option(help="The engine's --block-size.")] = 16,
    seed: Annotated[
        str | None,
        typer.Option(
            help="The engine's PYTHONHASHSEED; unset means vLLM >= 0.29's fixed default seed."
        ),
    ] = None,
    lora: Annotated[str | None, typer.Option(help="LoRA adapter name of the request.")] = None,
    lora_path: Annotated[
        str | None, typer.Option(help="The adapter's path (hashed with its name since vLLM 0.31).")
    ] = None,
    cache_salt: Annotated[str | None, typer.Option(help="The request's cache_salt.")] = None,
    extra_key_format: Annotated[
        str, typer.Option(help="'tagged' (vLLM >= 0.31) or 'legacy' (0.19-0.30).")
    ] = "tagged",
    as_int: Annotated[
        bool, typer.Option("--int", help="Print the uint64 events carry instead of hex digests.")
    ] = False,
) -> None:
    """Hash token ids (a JSON list on stdin) into one hash per full block."""
    from llmgw.engines import hash_seed_problem
    from llmgw.kv import KVError, block_hashes, hash64

    # The seed rule every other entry point applies (llmgw.engines): an engine
    # cannot run with any other PYTHONHASHSEED, so hashes for one match nothing.
    if seed is not None and (problem := hash_seed_problem(seed)) is not None:
        raise _fail(f"--seed {problem}; omit --seed for vLLM >= 0.29's fixed default seed")
    if block_size < 1:
        raise _fail(f"--block-size {block_size} must be 1 or more; use the engine's --block-size")

    try:
        tokens = json.loads(sys.stdin.read())
    except json.JSONDecodeError as exc:
        raise _fail(f"stdin is not JSON ({exc}); pipe a list of token ids like [1, 2, 3]") from None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise _fail("stdin must be a JSON list of non-negative integer token ids, like [1, 2, 3]")
    if extra_key_format not in ("tagged", "legacy"):
        raise _fail(f"--extra-key-format {extra_key_format!r} is unknown; use tagged or legacy")
    try:
        digests = block_hashes(
            tokens,
            block_size,
            seed=seed,
            lora_name=lora,
            lora_path=lora_path,
            cache_salt=cache_salt,
            extra_key_format=extra_key_format,  # type: ignore[arg-type]
        )
    except KVError as exc:
        raise _fail(exc.message) from None
    for digest in digests:
        typer.echo(str(hash64(digest)) if as_int else digest.hex())


def _jsonable(value: object) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


@app.command("decode")
def decode_command(
    hex_input: Annotated[
        bool, typer.Option("--hex", help="stdin holds the payload as hex text, not raw bytes.")
    ] = False,
    raw_hashes: Annotated[
        bool,
        typer.Option(help="Keep 32-byte digests as hex instead of projecting them to uint64."),
    ] = False,
) -> None:
    """Decode one KV event batch payload (msgpack, raw bytes on stdin) and print it as JSON."""
    from dataclasses import fields

    from llmgw.kv import KVDecodeError, decode_batch

    data = sys.stdin.buffer.read()
    if hex_input:
        try:
            data = bytes.fromhex(data.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise _fail("--hex input is not hex text") from None
    try:
        decoded = decode_batch(data, hash_form="raw" if raw_hashes else "int")
    except KVDecodeError as exc:
        raise _fail(exc.message) from None
    events = []
    for event in decoded.events:
        doc: dict[str, Any] = {"type": type(event).__name__}
        for f in fields(event):
            doc[f.name] = _jsonable(getattr(event, f.name))
        events.append(doc)
    batch = decoded.batch
    typer.echo(
        json.dumps(
            {
                "ts": batch.ts,
                "data_parallel_rank": batch.data_parallel_rank,
                "num_skipped": decoded.num_skipped,
                "events": events,
            },
            indent=2,
        )
    )
