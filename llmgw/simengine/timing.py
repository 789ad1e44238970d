"""The step cost model: how long one scheduler step takes on the modelled GPU.

duration = (step_overhead + prefill_per_token * uncached prefill tokens
            + decode_per_seq * decoding sequences) * time_scale

Only *uncached* prefill tokens cost time, which is what makes a prefix-cache
hit show up as a lower time-to-first-token exactly as on a GPU; `time_scale`
multiplies everything so benchmarks can run faster than modelled time while
keeping every ratio.

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

    def __post_init__(self) -> None:
        for name in ("step_overhead_ms", "prefill_ms_per_token", "decode_ms_per_seq", "time_scale"):
            value = getattr(self, name)
            if not value >= 0:  # also catches NaN
                raise ConfigError(
                    f"timing {name}={value} is negative; use a value >= 0", field=name
                )

    def step_duration_s(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        """Seconds one step takes in wall time (already multiplied by time_scale)."""
        ms = (
            self.step_overhead_ms
            + self.prefill_ms_per_token * num_prefill_tokens
            + self.decode_ms_per_seq * num_decode_seqs
        )
        return ms * self.time_scale / 1000.0
