"""The errors of the KV package: bad hashing parameters and undecodable event payloads.

    KVError            code "kv-invalid"        a hashing or encoding parameter breaks a rule
     └── KVDecodeError code "kv-decode-failed"  bytes from the network are not a vLLM KV message

Both are also ``ValueError`` so code that guards a parse with ``except ValueError`` keeps working.
The decoder raises nothing else for any input: it faces the network, and an arbitrary exception
escaping it would kill the listener that feeds the mirror. This module must not import anything
of llmgw's except ``llmgw.errors``.
"""

from __future__ import annotations

from llmgw.errors import LlmgwError

__all__ = ["KVDecodeError", "KVError"]


class KVError(LlmgwError, ValueError):
    """A hashing, encoding or mirror parameter that cannot produce vLLM-identical results."""

    code = "kv-invalid"


class KVDecodeError(KVError):
    """A ZMQ frame or msgpack payload that is not a well-formed vLLM KV event message."""

    code = "kv-decode-failed"
