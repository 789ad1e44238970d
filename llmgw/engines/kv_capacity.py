"""Pure: how many KV blocks a launched profile's engine holds, when its profile says.

The control plane's KV views (``kv.shard_views``) bound each shard's view by its engine's
capacity: a node's credential once grew every control plane's index without bound by
reporting blocks its engine could never hold (hardening-3 finding 7). The count is read from
the flags that fix it: the simulator's ``--num-blocks`` (4096 when absent, its default),
vLLM's ``--num-gpu-blocks-override``, SGLang's ``--max-total-tokens`` over the block size.
Anything else (vLLM sizing its cache from GPU memory, an unknown engine) is None: the caller
applies its own ceiling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from llmgw.engines.flags import flag_value, syntax_for

__all__ = ["kv_capacity_blocks"]

# The simulator's own default (`llmgw simengine --num-blocks`).
SIM_DEFAULT_BLOCKS: Final = 4096


def _flag(engine: str, args: Sequence[str], name: str) -> int | None:
    """The whole number the engine's parser reads for ``name`` in ``args`` (every spelling it
    accepts, the last one kept, as ``flags.flag_value`` reads them); None: absent or no number."""
    value = flag_value(args, (name,), syntax_for(engine))
    return int(value.strip()) if value is not None and value.strip().isdigit() else None


def kv_capacity_blocks(profile: Mapping[str, Any]) -> int | None:
    """KV blocks the engine of a launch spec's ``profile`` document holds, None: unknown."""
    engine = profile.get("engine")
    raw = profile.get("args")
    args = [str(a) for a in raw] if isinstance(raw, list | tuple) else []
    if engine == "sim":
        blocks = _flag(engine, args, "--num-blocks")
        return blocks if blocks else SIM_DEFAULT_BLOCKS
    if engine == "vllm":
        return _flag(engine, args, "--num-gpu-blocks-override") or None
    if engine == "sglang":
        tokens = _flag(engine, args, "--max-total-tokens")
        kv = profile.get("kv_hash")
        size = kv.get("block_size") if isinstance(kv, Mapping) else None
        if tokens and isinstance(size, int) and size > 0:
            return -(-tokens // size)
    return None
