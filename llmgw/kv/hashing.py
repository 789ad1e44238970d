"""vLLM's ``sha256_cbor`` prefix-caching block hash, byte for byte.

Holds the root hash (``none_hash``), the chain (``hash_block``), the extra keys a block is
salted with (``extra_keys_for_block``), the whole-prompt hasher (``block_hashes`` and
``BlockHasher``) and the 64-bit projection that KV events carry (``hash64``). The semantics
are those of vLLM's ``vllm/v1/core/kv_cache_utils.py`` (docs/architecture.md §7):

    parent_0 = NONE_HASH = sha256(cbor(seed))
    h_i      = sha256(cbor((parent_i, tuple(tokens[i*B:(i+1)*B]), extra_i)))   (canonical CBOR)
    event    = int.from_bytes(h_i[24:], "big")

Only full blocks are hashed: vLLM never hashes a partial tail, so a hash for one would match
nothing. The chain runs on the full 32-byte digests (vLLM >= 0.10.2); the 64-bit event value is
lossy and must never be chained from.

This module must NOT do I/O, read the environment (the seed is passed in: reading
PYTHONHASHSEED here would hash with the router's seed instead of the engine's), or import
anything of llmgw's but ``llmgw.errors`` via ``llmgw.kv.errors``.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Sequence
from typing import Literal, NewType

import cbor2

from llmgw.kv.errors import KVError

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_SEED",
    "BlockHash",
    "BlockHash64",
    "BlockHasher",
    "ExtraKeyFormat",
    "block_hashes",
    "extra_keys_for_block",
    "hash64",
    "hash_block",
    "none_hash",
    "scorable_blocks",
]

# A full 32-byte sha256_cbor digest: what the chain is built on.
BlockHash = NewType("BlockHash", bytes)
# The last 8 digest bytes as a big-endian unsigned int: what events carry and indexes key on.
BlockHash64 = NewType("BlockHash64", int)

# "tagged": vLLM >= 0.31 (("lora", name, path), ("cache_salt", salt)).
# "legacy": vLLM 0.19-0.30 (bare lora_name, bare salt string).
ExtraKeyFormat = Literal["tagged", "legacy"]

# vLLM >= 0.29 hashes the root from this string when PYTHONHASHSEED is unset (sha256 family);
# older releases used os.urandom, so an unseeded engine before 0.29 matches nothing we compute.
DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16

_MASK64 = (1 << 64) - 1
_sha256 = hashlib.sha256


def _cbor(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def none_hash(seed: str | None) -> BlockHash:
    """Root of every chain: sha256 over the CBOR text string of the seed (None: vLLM's default)."""
    if seed is not None and not isinstance(seed, str):
        # vLLM hashes PYTHONHASHSEED as the *string* it reads from the environment; hashing the
        # int 0 instead of "0" gives a different root and every lookup silently misses.
        raise KVError(
            f"seed {seed!r} is a {type(seed).__name__}; vLLM hashes PYTHONHASHSEED as a string: "
            f"pass seed={str(seed)!r}",
            field="seed",
        )
    return BlockHash(_sha256(_cbor(DEFAULT_SEED if seed is None else seed)).digest())


def hash_block(parent: bytes, tokens: Sequence[int], extra: tuple[object, ...] | None) -> BlockHash:
    """One link of the chain: the digest of (parent digest, this block's tokens, its extra keys)."""
    return BlockHash(_sha256(_cbor((bytes(parent), tuple(tokens), extra))).digest())


def hash64(digest: bytes) -> BlockHash64:
    """The 64-bit value vLLM puts in events for a digest (last 8 bytes, big-endian)."""
    if len(digest) < 8:
        raise KVError(
            f"block hash {digest.hex()!r} has {len(digest)} bytes; a 64-bit event value needs "
            "at least 8 (a sha256_cbor digest has 32)",
            field="digest",
        )
    return BlockHash64(int.from_bytes(digest[-8:], "big"))


def scorable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt can ever be a cache hit.

    vLLM caps a hit at num_tokens - 1 (the last token must be computed to produce logits), so
    when the length is a multiple of the block size the last full block never hits: scoring it
    would reward a replica for a block it cannot serve.
    """
    return max(0, num_tokens - 1) // block_size


def extra_keys_for_block(
    block_index: int,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    extra_key_format: ExtraKeyFormat = "tagged",
) -> tuple[object, ...] | None:
    """The ``extra`` element hashed with block ``block_index`` (None for a plain text request).

    Order is vLLM's: LoRA, (multimodal: not supported here), cache salt on block 0 only.
    """
    keys: list[object] = []
    if extra_key_format == "tagged":
        if lora_name is not None:
            if lora_path is None:
                # vLLM >= 0.31 hashes ("lora", name, path); hashing without the path would give
                # hashes that match no block the engine holds, with no error anywhere.
                raise KVError(
                    f"LoRA {lora_name!r} has no lora_path; vLLM >= 0.31 hashes the adapter's path "
                    "with its name: pass lora_path, or extra_key_format='legacy' for 0.19-0.30",
                    field="lora_path",
                )
            keys.append(("lora", lora_name, lora_path))
        if cache_salt and block_index == 0:
            keys.append(("cache_salt", cache_salt))
    elif extra_key_format == "legacy":
        if lora_name is not None:
            keys.append(lora_name)
        if cache_salt and block_index == 0:
            keys.append(cache_salt)
    else:
        raise KVError(
            f"extra_key_format {extra_key_format!r} is unknown; use 'tagged' (vLLM >= 0.31) "
            "or 'legacy' (0.19-0.30)",
            field="extra_key_format",
        )
    return tuple(keys) if keys else None


# --- fast path ---------------------------------------------------------------------------------
#
# vLLM encodes every block with cbor2.dumps((parent, tuple(block), extra)): ~3-5 us per block, most
# of it building tuples and an encoder per call, on the router's request path. The CBOR of that
# tuple is a fixed prefix (0x83: array of 3; 0x58 0x20: 32-byte bstr), the parent, the block's token
# array and the encoded extra. So the cold path encodes all of a prompt's tokens in ONE cbor2 call,
# with a marker item after every block, and splits the bytes at the markers. The marker's encoding
# has no border (no proper prefix equal to a suffix), so two occurrences cannot overlap: a token
# sequence that encoded to it would add a piece, the count check would see it and the prompt would
# take the naive path. For uint32 tokens it cannot even happen (bytes c3 and 1d are no uint
# header and 6 marker bytes cannot fit one 4-byte payload), but correctness rests on the check,
# not on that argument. The cold path costs ~3.5-4.5x the bare SHA-256 calls: cbor2's bulk int
# encoding alone (~35 ns per token) is ~1.5x them, and is the fastest exact encoder available.
#
# The warm path (a prefix seen before: system prompts, multi-turn chats) skips CBOR entirely: the
# memo maps (parent digest + the chunk's tokens as uint32 bytes) -> the chunk's digests, for chunks
# of _CHUNK blocks anchored at the prompt's start, so a warm prompt costs one dict lookup per chunk.

_PREFIX = b"\x83\x58\x20"
_MARKER = 0xC3A95E1D7B0F2684
_MARKER_CBOR = cbor2.dumps(_MARKER)  # 1b c3a95e1d7b0f2684: border-free (tests/kv checks)
_CHUNK = 8  # blocks per memo entry: one lookup per 128 tokens at block size 16


def _array_header_len(n: int) -> int:
    return 1 if n < 24 else 2 if n < 0x100 else 3 if n < 0x10000 else 5 if n < 0x100000000 else 9


class BlockHasher:
    """Hashes prompts for one set of hash parameters, remembering recent prefixes.

    One instance per (seed, block size, LoRA, salt, format): the router groups replicas by those
    parameters and hashes a prompt once per group. Token ids are ints (vLLM's never are bools).
    Not thread-safe: the memo is a plain dict, fine for one event loop.
    """

    __slots__ = (
        "_block_size",
        "_extra_first",
        "_extra_rest",
        "_header",
        "_memo_max",
        "_old",
        "_root",
        "_suffix_first",
        "_suffix_rest",
        "_young",
    )

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        seed: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        extra_key_format: ExtraKeyFormat = "tagged",
        memo_blocks: int = 16384,
    ) -> None:
        if type(block_size) is not int or block_size < 1:
            raise KVError(
                f"block_size {block_size!r} is not a positive int; use the engine's --block-size "
                "(vLLM's default is 16)",
                field="block_size",
            )
        self._block_size = block_size
        self._root = none_hash(seed)
        self._extra_first = extra_keys_for_block(
            0,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            extra_key_format=extra_key_format,
        )
        self._extra_rest = extra_keys_for_block(
            1,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            extra_key_format=extra_key_format,
        )
        self._header = cbor2.dumps([0] * block_size)[:-block_size]
        self._suffix_first = _cbor(self._extra_first)
        self._suffix_rest = _cbor(self._extra_rest)
        # Two generations instead of an LRU list: a lookup is one or two dict probes and eviction
        # drops a whole generation at once, so the hot path never pays for recency bookkeeping.
        self._young: dict[bytes, tuple[BlockHash, ...]] = {}
        self._old: dict[bytes, tuple[BlockHash, ...]] = {}
        self._memo_max = max(1, memo_blocks // _CHUNK // 2)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def root(self) -> BlockHash:
        return self._root

    def hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The digests of the prompt's full blocks, in order (a partial tail gets none)."""
        bsz = self._block_size
        n_blocks = len(token_ids) // bsz
        if n_blocks == 0:
            return []
        # Work on the caller's list in place: a copy of a 32k-token prompt costs ~5% of a cold hash.
        used = token_ids if type(token_ids) is list else list(token_ids)
        try:
            raw = array("I", used).tobytes()[: n_blocks * bsz * 4]
        except (OverflowError, TypeError, ValueError):
            # Negative, >= 2**32 or non-int tokens: nothing a tokenizer emits, but vLLM would
            # still hash them, so take the naive path rather than refuse.
            return self._naive(used, 0, n_blocks, self._root)
        out: list[BlockHash] = []
        parent = self._root
        young, old = self._young, self._old
        step = _CHUNK * bsz * 4
        done = 0
        if young or old:
            for start in range(0, len(raw), step):
                key = parent + raw[start : start + step]
                chunk = young.get(key)
                if chunk is None:
                    chunk = old.get(key)
                    if chunk is None:
                        break
                    young[key] = chunk
                out.extend(chunk)
                parent = chunk[-1]
            done = len(out)
        if done < n_blocks:
            digests = self._cold(used, done, n_blocks, parent)
            self._remember(raw, done, parent, digests)
            out.extend(digests)
        return out

    def _remember(
        self, raw: bytes, first: int, parent: BlockHash, digests: list[BlockHash]
    ) -> None:
        step = _CHUNK * self._block_size * 4
        young = self._young
        for i in range(0, len(digests), _CHUNK):
            start = (first + i) * self._block_size * 4
            chunk = tuple(digests[i : i + _CHUNK])
            young[parent + raw[start : start + step]] = chunk
            parent = chunk[-1]
        if len(young) > self._memo_max:
            self._old = young
            self._young = {}

    def _cold(self, used: list[int], first: int, end: int, parent: BlockHash) -> list[BlockHash]:
        bsz = self._block_size
        n = end - first
        flat: list[int] = [_MARKER] * (n * (bsz + 1))
        base = first * bsz
        for j in range(bsz):
            flat[j :: bsz + 1] = used[base + j : end * bsz : bsz]
        try:
            pieces = cbor2.dumps(flat).split(_MARKER_CBOR)
        except (ValueError, TypeError, OverflowError):
            return self._naive(used, first, end, parent)
        if len(pieces) != n + 1:
            # Some block's tokens encode to the marker: exactness first.
            return self._naive(used, first, end, parent)
        pieces[0] = pieces[0][_array_header_len(len(flat)) :]
        sha = _sha256
        pre = _PREFIX
        hdr = self._header
        suf = self._suffix_rest
        out: list[BlockHash] = []
        append = out.append
        if first == 0:
            parent = BlockHash(sha(pre + parent + hdr + pieces[0] + self._suffix_first).digest())
            append(parent)
            del pieces[0]
        del pieces[-1]
        for piece in pieces:
            parent = sha(pre + parent + hdr + piece + suf).digest()  # type: ignore[assignment]
            append(parent)
        return out

    def _naive(self, used: list[int], first: int, end: int, parent: BlockHash) -> list[BlockHash]:
        bsz = self._block_size
        out: list[BlockHash] = []
        for i in range(first, end):
            extra = self._extra_first if i == 0 else self._extra_rest
            try:
                parent = hash_block(parent, used[i * bsz : (i + 1) * bsz], extra)
            except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
                raise KVError(
                    f"token ids of block {i} cannot be hashed ({exc}); token ids are ints",
                    field="token_ids",
                ) from None
            out.append(parent)
        return out


# Few parameter sets are live at once (one per model and LoRA); each memo is ~2 MB at most.
_HASHERS_MAX = 16


@functools.lru_cache(maxsize=_HASHERS_MAX, typed=True)
def _hasher(
    block_size: int,
    seed: str | None,
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
    extra_key_format: ExtraKeyFormat,
) -> BlockHasher:
    # Least recently used goes first: a busy tenant's hasher (and its warm memo) stays. A
    # constructor error is not cached (lru_cache stores only returned values).
    return BlockHasher(
        block_size,
        seed=seed,
        lora_name=lora_name,
        lora_path=lora_path,
        cache_salt=cache_salt,
        extra_key_format=extra_key_format,
    )


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    extra_key_format: ExtraKeyFormat = "tagged",
) -> list[BlockHash]:
    """The full-block digests vLLM computes for ``token_ids`` (a partial tail gets none).

    Reuses a cached ``BlockHasher`` per parameter set, so repeated prefixes hit its memo.
    """
    try:
        hasher = _hasher(block_size, seed, lora_name, lora_path, cache_salt, extra_key_format)
    except TypeError:
        # An unhashable parameter (a list for a seed, say) cannot key the cache: build one so
        # the constructor reports it as the KVError it is.
        hasher = BlockHasher(
            block_size,
            seed=seed,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            extra_key_format=extra_key_format,
        )
    return hasher.hashes(token_ids)
