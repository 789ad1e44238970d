"""vLLM-compatible KV-cache pieces, pure: block hashing, the KV event wire codec, the agent's
block mirror and the router's prefix index.

API summary:

- ``block_hashes(token_ids, block_size, *, seed, lora_name, lora_path, cache_salt,
  extra_key_format)`` -> full-block ``sha256_cbor`` digests exactly as vLLM computes them;
  ``hash64(digest)`` -> the uint64 events carry; ``BlockHasher`` keeps a memo per parameter set;
  ``none_hash``, ``hash_block`` and ``extra_keys_for_block`` are the chain's pieces;
  ``scorable_blocks`` says how many leading blocks can ever hit.
- ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``EventBatch``: typed events.
- ``encode_batch``/``decode_batch``: msgpack payloads in both shapes (arrays <= 0.23, maps
  >= 0.24) and both hash forms; ``encode_message``/``decode_message`` and the replay frame
  helpers (``llmgw.kv.frames``); malformed input raises ``KVDecodeError`` only.
- ``BlockMirror`` (agent side, one per engine): ``apply(seq, batch)`` in order (gaps are
  reported, never skipped), ``resync``/``engine_started`` resets, ``changes_since(version)`` ->
  ``MirrorDelta`` or ``MirrorSnapshot`` (with its reset reason), ``dump``/``load``; blocks are
  kept per medium, and events on a medium outside ``KNOWN_MEDIA`` are counted and dropped.
- ``PrefixIndex`` (router side, one per process): ``apply_delta``/``apply_snapshot``/
  ``apply_change``/``drop_shard`` per (model, shard); ``score(model, hashes, candidates)`` ->
  ``PrefixScore`` per candidate (leading blocks held, share, partial); ``media=`` limits the
  tiers that count (the router scores ``DEVICE_MEDIUM`` only: offloaded blocks are no hit).

Nothing here does I/O, imports zmq/asyncio or reads the environment: the ZMQ listener belongs to
the node agent, the publisher to the simulator.
"""

from llmgw.kv.codec import *  # noqa: F403
from llmgw.kv.codec import __all__ as _codec_all
from llmgw.kv.errors import *  # noqa: F403
from llmgw.kv.errors import __all__ as _errors_all
from llmgw.kv.events import *  # noqa: F403
from llmgw.kv.events import __all__ as _events_all
from llmgw.kv.frames import *  # noqa: F403
from llmgw.kv.frames import __all__ as _frames_all
from llmgw.kv.hashing import *  # noqa: F403
from llmgw.kv.hashing import __all__ as _hashing_all
from llmgw.kv.index import *  # noqa: F403
from llmgw.kv.index import __all__ as _index_all
from llmgw.kv.mirror import *  # noqa: F403
from llmgw.kv.mirror import __all__ as _mirror_all

__all__ = [
    *_codec_all,
    *_errors_all,
    *_events_all,
    *_frames_all,
    *_hashing_all,
    *_index_all,
    *_mirror_all,
]
