"""``encode_batch`` against msgspec itself, with structs shaped like every vLLM release's.

msgspec is what vLLM encodes with; it is not a dependency of llmgw, so this test runs where it
is installed (``pip install msgspec``) and is skipped elsewhere. The goldens in test_codec.py
pin the same bytes without it.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch
from llmgw.kv.codec import _LAYOUTS

msgspec = pytest.importorskip("msgspec")

_STORED = [f for f in BlockStored.__slots__]  # declaration order is wire order
_REMOVED = [f for f in BlockRemoved.__slots__]


def _vllm_structs(num_stored: int, num_removed: int, array_like: bool, has_rank: bool) -> Any:
    opts = {"array_like": array_like, "omit_defaults": True, "gc": False, "tag": True}

    class KVCacheEvent(msgspec.Struct, **opts):  # type: ignore[misc, call-arg]
        pass

    def fields(names: list[str], required: int) -> list[tuple[Any, ...]]:
        return [(n, Any) if i < required else (n, Any, None) for i, n in enumerate(names)]

    stored = msgspec.defstruct(
        "BlockStored", fields(_STORED[:num_stored], 7), bases=(KVCacheEvent,), **opts
    )
    removed = msgspec.defstruct(
        "BlockRemoved", fields(_REMOVED[:num_removed], 2), bases=(KVCacheEvent,), **opts
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(KVCacheEvent,), **opts)
    batch_fields: list[Any] = [("ts", float), ("events", list)]
    if has_rank:
        batch_fields.append(("data_parallel_rank", Any, None))
    batch = msgspec.defstruct(
        "KVEventBatch", batch_fields, array_like=True, omit_defaults=True, gc=False
    )
    return stored, removed, cleared, batch


_u64 = st.integers(0, 2**64 - 1)
_opt_str = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "x" * 40]))
_opt_int = st.one_of(st.none(), st.integers(0, 70000))


@st.composite
def _case(draw: st.DrawFn) -> tuple[tuple[int, int, int], EventBatch]:
    version = draw(st.sampled_from(sorted(_LAYOUTS)))
    layout = _LAYOUTS[version]
    events: list[Any] = []
    for kind in draw(st.lists(st.sampled_from(["s", "r", "c"]), max_size=4)):
        if kind == "c":
            events.append(AllBlocksCleared())
            continue
        names = _STORED[: layout.num_stored] if kind == "s" else _REMOVED[: layout.num_removed]
        values: dict[str, Any] = {}
        for name in names:
            if name == "block_hashes":
                values[name] = tuple(draw(st.lists(_u64, max_size=3)))
            elif name == "token_ids":
                values[name] = tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)))
            elif name == "block_size":
                values[name] = draw(st.integers(0, 64))
            elif name == "parent_block_hash":
                values[name] = draw(st.one_of(st.none(), _u64))
            elif name in ("lora_id", "group_idx", "kv_cache_spec_sliding_window"):
                values[name] = draw(_opt_int)
            elif name == "extra_keys":
                values[name] = draw(st.one_of(st.none(), st.just((None, ("salt",)))))
            elif name == "lookahead_token_ids":
                values[name] = draw(st.one_of(st.none(), st.just(((1, 2), ()))))
            else:
                values[name] = draw(_opt_str)
        events.append((BlockStored if kind == "s" else BlockRemoved)(**values))
    rank = draw(st.integers(0, 3)) if layout.has_rank else None
    return version, EventBatch(draw(st.floats(0, 2e9)), tuple(events), rank)


@settings(deadline=None, max_examples=300)
@given(case=_case())
def test_encoder_matches_msgspec_for_every_layout(
    case: tuple[tuple[int, int, int], EventBatch],
) -> None:
    version, batch = case
    layout = _LAYOUTS[version]
    stored, removed, cleared, batch_type = _vllm_structs(
        layout.num_stored, layout.num_removed, layout.shape == "array", layout.has_rank
    )
    structs = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            structs.append(stored(*[getattr(e, n) for n in _STORED[: layout.num_stored]]))
        elif isinstance(e, BlockRemoved):
            structs.append(removed(*[getattr(e, n) for n in _REMOVED[: layout.num_removed]]))
        else:
            structs.append(cleared())
    args: list[Any] = [batch.ts, structs]
    if layout.has_rank:
        args.append(batch.data_parallel_rank)
    expected = msgspec.msgpack.encode(batch_type(*args))
    assert encode_batch(batch, vllm_version=".".join(map(str, version))) == expected
