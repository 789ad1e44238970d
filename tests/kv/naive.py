"""A deliberately naive vLLM ``sha256_cbor`` chain, written from the reference §3/§6 recipe.

Every block goes through ``cbor2.dumps((parent, tuple(block), extra), canonical=True)`` the way
vLLM does; the fast path in ``llmgw.kv.hashing`` must agree with this byte for byte.
"""

from __future__ import annotations

import hashlib

import cbor2

__all__ = ["naive_block_hashes"]


def naive_block_hashes(
    tokens: list[int],
    block_size: int,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    salt: str | None = None,
    tagged: bool = True,
) -> list[bytes]:
    def h(x: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    parent = h("vllm-none-hash" if seed is None else seed)
    out = []
    for i in range(len(tokens) // block_size):
        keys: list[object] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]) if tagged else lora[0])
        if salt and i == 0:
            keys.append(("cache_salt", salt) if tagged else salt)
        extra = tuple(keys) if keys else None
        parent = h((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
        out.append(parent)
    return out
