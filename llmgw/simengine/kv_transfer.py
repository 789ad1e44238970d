"""Prefill/decode disaggregation's pure part: `--kv-transfer-config` and which blocks move.

The simulator models vLLM's ExampleConnector (called SharedStorageConnector before vLLM 0.12),
the connector vLLM ships to show a KV connector's contract: a *producer* (`kv_producer` or
`kv_both`) writes the KV of every prompt it computes to a directory, a *consumer*
(`kv_consumer` or `kv_both`) looks a new request's prompt up there before scheduling it and
loads what it finds instead of computing it. That is prefill/decode disaggregation at its
simplest: a prefill engine (producer) answers `max_tokens: 1`, a decode engine (consumer)
then gets the same prompt and only loads its KV.

Where the simulator differs from vLLM's ExampleConnector, and why:

- One file per full block, named by the block's prefix-cache hash (the one KV events carry
  in full), instead of one folder per prompt: engines with the same model, block size and
  hash seed then share any common prefix, not just identical prompts, and the files say
  what the store holds without a tensor in them (the simulator has none).
- `shared_storage_path` is required (vLLM defaults it to /tmp): a default shared by every
  simulator on the machine would make unrelated test runs hit each other's blocks.
- Unknown keys are refused, as in KvEventsConfig: a typo such as "kv_rol" would silently
  run an engine that never stores or loads anything.

Must NOT do I/O: kv_storage.py reads and writes the directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from llmgw.errors import ConfigError
from llmgw.kv.hashing import BlockHash

__all__ = [
    "CONNECTORS",
    "KvRole",
    "KvSave",
    "KvTransfer",
    "KvTransferConfig",
    "block_file_body",
    "block_file_name",
    "leading_run",
    "lookup_span",
    "parse_kv_transfer_config",
    "prompt_blocks_to_store",
]

KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
# ExampleConnector's name since vLLM 0.12 and the one it had before.
CONNECTORS = ("ExampleConnector", "SharedStorageConnector")
_FLAG = "--kv-transfer-config"


class KvTransferConfig(BaseModel):
    """vLLM's KVTransferConfig field names. The simulator uses kv_connector, kv_role and
    kv_connector_extra_config; the rest are accepted so a vLLM command line runs unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str | None = None
    kv_role: KvRole | None = None
    kv_connector_extra_config: dict[str, Any] = {}
    # Accepted for vLLM compatibility and unused: they place a real connector's buffers and
    # peers (NCCL ranks, NIXL side channels), which the simulator has none of.
    engine_id: Any = None
    kv_buffer_device: Any = None
    kv_buffer_size: Any = None
    kv_rank: Any = None
    kv_parallel_size: Any = None
    kv_ip: Any = None
    kv_port: Any = None
    kv_connector_module_path: Any = None
    enable_permute_local_kv: Any = None
    kv_load_failure_policy: Any = None


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """A validated `--kv-transfer-config`: what the engine does with the shared storage."""

    role: KvRole
    storage_path: str
    connector: str = "ExampleConnector"

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(raw: str | None) -> KvTransfer | None:
    """The flag's JSON object, validated; None when it is absent (no connector)."""
    if raw is None or not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{_FLAG} is not JSON ({exc.msg} at char {exc.pos}); pass an object like "
            '\'{"kv_connector":"ExampleConnector","kv_role":"kv_both",'
            '"kv_connector_extra_config":{"shared_storage_path":"/srv/kv"}}\'',
            field="kv_transfer_config",
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_FLAG} is a JSON {type(data).__name__}; pass an object",
            field="kv_transfer_config",
        )
    try:
        config = KvTransferConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ConfigError(
            f"{_FLAG} is invalid ({problems}); use vLLM's KVTransferConfig field names, "
            "with kv_role one of kv_producer, kv_consumer, kv_both",
            field="kv_transfer_config",
        ) from None
    if config.kv_connector is None:
        if config.kv_role is not None or config.kv_connector_extra_config:
            raise ConfigError(
                f"{_FLAG} sets a role or extra config but no kv_connector; "
                f'add "kv_connector": "{CONNECTORS[0]}"',
                field="kv_transfer_config.kv_connector",
            )
        return None  # vLLM too runs without a connector when none is named
    if config.kv_connector not in CONNECTORS:
        raise ConfigError(
            f"{_FLAG} kv_connector {config.kv_connector!r} is not simulated; use "
            f"{' or '.join(CONNECTORS)} (vLLM's shared-storage connector)",
            field="kv_transfer_config.kv_connector",
        )
    if config.kv_role is None:
        # vLLM's own check: a connector without a role neither stores nor loads.
        raise ConfigError(
            f"{_FLAG} names kv_connector {config.kv_connector!r} but no kv_role; add "
            '"kv_role": "kv_producer", "kv_consumer" or "kv_both"',
            field="kv_transfer_config.kv_role",
        )
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - {"shared_storage_path"})
    if unknown:
        raise ConfigError(
            f"{_FLAG} kv_connector_extra_config has unknown keys {unknown}; "
            f"{config.kv_connector} reads only shared_storage_path",
            field="kv_transfer_config.kv_connector_extra_config",
        )
    path = extra.get("shared_storage_path")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(
            f"{_FLAG} needs kv_connector_extra_config.shared_storage_path, a directory that "
            'producer and consumer share, e.g. {"shared_storage_path": "/srv/kv"}',
            field="kv_transfer_config.kv_connector_extra_config.shared_storage_path",
        )
    return KvTransfer(role=config.kv_role, storage_path=path, connector=config.kv_connector)


@dataclass(frozen=True, slots=True)
class KvSave:
    """A prompt's full blocks for a producer to store: hashes in chain order, their tokens."""

    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size of them
    block_size: int

    def blocks(self) -> list[tuple[BlockHash | None, BlockHash, tuple[int, ...]]]:
        """(parent, hash, tokens) per block."""
        size = self.block_size
        return [
            (
                self.block_hashes[i - 1] if i else None,
                h,
                self.token_ids[i * size : (i + 1) * size],
            )
            for i, h in enumerate(self.block_hashes)
        ]


def prompt_blocks_to_store(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading blocks of a computed prompt a producer stores: every full one. The
    partial tail is never stored (it has no hash), and a block holding output tokens neither,
    as ExampleConnector stores prompt tokens only."""
    return num_prompt_tokens // block_size


def lookup_span(
    num_local_blocks: int, num_prompt_tokens: int, num_tokens: int, block_size: int
) -> tuple[int, int]:
    """The block indexes [start, end) a consumer looks up in the shared storage.

    From the end of the local prefix hit (what the engine's own cache holds is never
    loaded), to the last full prompt block that leaves at least one token to compute: the
    last token is always computed, it produces the next output (the local hit's cap too).
    `num_tokens` is the prompt plus any output already emitted (a preempted request);
    output blocks are never stored, so the span stays within the prompt.
    """
    end = min((num_tokens - 1) // block_size, num_prompt_tokens // block_size)
    start = min(num_local_blocks, end)
    return start, end


def leading_run(hashes: Sequence[BlockHash], present: Callable[[BlockHash], bool]) -> int:
    """How many of `hashes`, from the first, are present: a chain is usable only up to its
    first gap, as a prefix-cache hit is."""
    for i, block_hash in enumerate(hashes):
        if not present(block_hash):
            return i
    return len(hashes)


def block_file_name(block_hash: BlockHash) -> str:
    """A stored block's file name: the full digest in hex, so no two blocks can collide."""
    return f"{bytes(block_hash).hex()}.kv"


def block_file_body(parent: BlockHash | None, tokens: Sequence[int]) -> bytes:
    """What a block's file holds: its parent and tokens (what the hash covers), a few hundred
    bytes; the simulator has no tensors, and these let an operator see what a file is."""
    body = {"parent": None if parent is None else bytes(parent).hex(), "token_ids": list(tokens)}
    return json.dumps(body, separators=(",", ":")).encode()
