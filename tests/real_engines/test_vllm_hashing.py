"""llmgw's block hashes equal those vLLM's own code computes, for pinned vLLM releases.

The router scores prompts by the hashes ``llmgw.kv`` computes; they match an engine's cached
blocks only if they equal vLLM's bit for bit. The golden values in tests/kv/test_hashing.py
were made once; here vLLM's own ``get_request_block_hasher``, ``init_none_hash``,
``sha256_cbor`` and ``maybe_convert_block_hash`` (``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``, from the wheels tests/support/vllm_source.py fetches) compute them
for each case, with the extra-key format of their release: tagged in 0.33.0 (LoRA as
``("lora", name, path)``, ``("cache_salt", salt)``), bare values in 0.23.0.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.kv import block_hashes, hash64
from tests.support.vllm_source import NEWEST, OLDER, SourceUnavailable, fetch, load_block_hashing

# e2e too: on a machine without the wheels cached, the session fixture runs `pip download`.
pytestmark = [pytest.mark.real_engine, pytest.mark.e2e]

# The extra-key format llmgw is configured with for each release.
FORMATS = {NEWEST: "tagged", OLDER: "legacy"}


@pytest.fixture(scope="session")
def vllm_sources() -> dict[str, Path]:
    try:
        return {v: fetch(v, log=lambda line: print(line, file=sys.stderr)) for v in FORMATS}
    except SourceUnavailable as exc:
        pytest.skip(f"vLLM's own block hashing could not be fetched, NOT tested: {exc}")


@pytest.fixture(params=list(FORMATS))
def vllm(request: pytest.FixtureRequest, vllm_sources: dict[str, Path]) -> Iterator[Any]:
    """(release, kv_cache_utils, hashing) imported here; the stubs go afterwards."""
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    try:
        utils = load_block_hashing(vllm_sources[request.param])
        yield request.param, utils, sys.modules["vllm.utils.hashing"]
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)


CASES = [
    # (seed, block size, number of tokens, LoRA (name, path), cache salt)
    ("12345", 16, 16 * 5 + 7, None, None),
    ("12345", 16, 64, ("adapter-a", "/adapters/a"), None),
    ("12345", 16, 48, None, "tenant-a"),
    ("4242", 4, 4 * 9 + 1, ("adapter-b", "/adapters/b"), "tenant-b"),
    (None, 16, 40, None, None),  # PYTHONHASHSEED unset: 0.29+ hashes a fixed default seed
]


@pytest.mark.parametrize(("seed", "block_size", "num_tokens", "lora", "salt"), CASES)
def test_llmgw_block_hashes_equal_vllms(
    vllm: Any,
    monkeypatch: pytest.MonkeyPatch,
    seed: str | None,
    block_size: int,
    num_tokens: int,
    lora: tuple[str, str] | None,
    salt: str | None,
) -> None:
    version, utils, hashing = vllm
    if seed is None and version == OLDER:
        # Nothing to match: vLLM before 0.29 draws a random root per process when
        # PYTHONHASHSEED is unset, which is why llmgw always sets it (KVHashParams.seed).
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        utils.init_none_hash(hashing.sha256_cbor)
        first = utils.NONE_HASH
        utils.init_none_hash(hashing.sha256_cbor)
        assert first != utils.NONE_HASH
        return
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    utils.init_none_hash(hashing.sha256_cbor)
    tokens = [(i * 7919) % 50_000 for i in range(num_tokens)]
    # The attributes of vLLM's Request that its block hasher reads.
    request = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=[],
        lora_request=None
        if lora is None
        else SimpleNamespace(lora_name=lora[0], lora_path=lora[1]),
        cache_salt=salt,
        prompt_embeds=None,
    )
    theirs = utils.get_request_block_hasher(block_size, hashing.sha256_cbor)(request)
    ours = block_hashes(
        tokens,
        block_size,
        seed=seed,
        lora_name=None if lora is None else lora[0],
        lora_path=None if lora is None else lora[1],
        cache_salt=salt,
        extra_key_format=FORMATS[version],
    )
    assert len(theirs) == num_tokens // block_size
    assert [bytes(h) for h in ours] == [bytes(h) for h in theirs]
    # The value events carry, which the router looks up.
    assert [hash64(h) for h in ours] == [utils.maybe_convert_block_hash(h) for h in theirs]
