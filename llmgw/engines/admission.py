"""How many requests a replica of a profile takes at once before the gateway queues the rest.

A profile's ``max_in_flight`` (0: this default) is the gateway's per-replica admission
ceiling: requests running plus waiting at the engine, all gateways together. The default is
the engine's own batch limit, read from the profile's args where the engine takes it, times
its data-parallel degree (each rank batches on its own), plus a waiting allowance of half a
batch (at least 4):

    engine    batch limit (flag, default when absent)
    vllm      --max-num-seqs, 256 (vLLM's default for the OpenAI server; recent builds
              raise it on large GPUs, which the profile states by passing the flag)
    sim       --max-num-seqs, 256 (the simulator's scheduler default, the same flag)
    sglang    --max-running-requests, 256 (SGLang sizes it from memory when absent; 256 is
              below what it picks on a datacenter GPU, so the engine is not overrun)
    trtllm    --max_batch_size, 2048 (trtllm-serve's default)
    llamacpp  --parallel / -np, 1 (llama-server's slots: one unless told)
    megatron  --inference-max-requests, 64 (no stable default across versions: a cautious one)

Why an allowance and why only half a batch: with none, a slot freed at the engine stays empty
for a gateway round trip (the next request is still in the gateway's queue); with more, the
wait moves from the gateway's queue, which is fair across keys, into the engine's, which is
first come first served, and a burst from one key is back to starving the others.

Why it is not in the fingerprint: the ceiling changes what the gateway sends, not the process
it is sent to (the flags above are the engine's own and already count there), so editing
``max_in_flight`` rolls nothing.

What it must NOT do: read anything but the profile.
"""

from __future__ import annotations

from typing import Final

from llmgw.engines.flags import flag_value, syntax_for
from llmgw.engines.registry import reference_engine
from llmgw.engines.spec import Profile
from llmgw.errors import SpecError

__all__ = ["BATCH_FLAGS", "default_max_in_flight", "max_in_flight"]

# engine -> (the flag's spellings, its default when absent)
BATCH_FLAGS: Final[dict[str, tuple[tuple[str, ...], int]]] = {
    "vllm": (("--max-num-seqs",), 256),
    "sim": (("--max-num-seqs",), 256),
    "sglang": (("--max-running-requests",), 256),
    "trtllm": (("--max_batch_size", "--max-batch-size"), 2048),
    "llamacpp": (("--parallel", "-np"), 1),
    "megatron": (("--inference-max-requests",), 64),
}
_UNKNOWN_ENGINE_BATCH = 64
_MIN_ALLOWANCE = 4


def _batch_limit(profile: Profile) -> int:
    names, default = BATCH_FLAGS.get(profile.engine, ((), _UNKNOWN_ENGINE_BATCH))
    text = flag_value(profile.args, names, syntax_for(profile.engine)) if names else None
    if text is None or not text.strip():
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise SpecError(
            f"profile {profile.name!r}: {names[0]} {text!r} is not a whole number; give the "
            "engine's batch limit as an integer",
            field="args",
        ) from None
    return value if value > 0 else default


def default_max_in_flight(profile: Profile) -> int:
    """The ceiling a profile gets when it sets none (the module docstring's table)."""
    batch = _batch_limit(profile)
    try:
        dp = reference_engine(profile.engine).data_parallel_size(profile)
    except (SpecError, KeyError, LookupError):
        dp = 1
    batch *= max(1, dp)
    return batch + max(_MIN_ALLOWANCE, batch // 2)


def max_in_flight(profile: Profile) -> int:
    """The ceiling in force: the profile's own, else the engine's default."""
    return profile.max_in_flight if profile.max_in_flight > 0 else default_max_in_flight(profile)
