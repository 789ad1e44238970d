"""The step cost model: how long one scheduler step takes on the modelled GPU.

duration = (step_overhead + prefill_per_token * uncached prefill tokens
            + decode_per_seq * decoding sequences
            + kv_load_per_token * tokens loaded from a KV connector) * time_scale

Only *uncached* prefill tokens cost compute, which is what makes a prefix-cache
hit show up as a lower time-to-first-token exactly as on a GPU. Prefill tokens
are charged to the whole step, so decodes batched with a prefill chunk wait for
it, as they do on a GPU. Tokens a consumer loads from a KV connector
(kv_transfer.py) are not prefill: they cost `kv_load_ms_per_token` each, the
transfer, also charged to the whole step because vLLM's shared-storage
connector loads before the forward pass and the batch waits. The default,
5 us per token, is about 128 KiB of KV per token (an 8B model in bf16) at
25 GB/s; a tenth of the default prefill cost. `time_scale` multiplies
everything so benchmarks can run faster than modelled time while keeping
every ratio.

Must NOT sleep or read clocks: the shell does that with the number returned.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.errors import ConfigError

__all__ = ["TimingModel"]


@dataclass(frozen=True, slots=True)
class TimingModel:
    step_overhead_ms: float = 2.0
    prefill_ms_per_token: float = 0.05
    decode_ms_per_seq: float = 0.3
    time_scale: float = 1.0
    kv_load_ms_per_token: float = 0.005

    def __post_init__(self) -> None:
        for name in (
            "step_overhead_ms",
            "prefill_ms_per_token",
            "decode_ms_per_seq",
            "time_scale",
            "kv_load_ms_per_token",
        ):
            value = getattr(self, name)
            if not value >= 0:  # also catches NaN
                raise ConfigError(
                    f"timing {name}={value} is negative; use a value >= 0", field=name
                )

    def step_duration_s(
        self, num_prefill_tokens: int, num_decode_seqs: int, num_loaded_tokens: int = 0
    ) -> float:
        """Seconds one step takes in wall time (already multiplied by time_scale)."""
        ms = (
            self.step_overhead_ms
            + self.prefill_ms_per_token * num_prefill_tokens
            + self.decode_ms_per_seq * num_decode_seqs
            + self.kv_load_ms_per_token * num_loaded_tokens
        )
        return ms * self.time_scale / 1000.0
