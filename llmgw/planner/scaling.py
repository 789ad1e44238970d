"""The autoscaler's pass: the leader's demand history and ``decide`` for every autoscaled
deployment of a snapshot, folded into the snapshot the plan then converges on.

``DemandHistory`` keeps, per model name, the samples of the last passes (bounded in time by
the longest window a policy may give and in count), recorded by the shell once per pass from
``gateway_demand``. ``scale_snapshot`` asks ``autoscale.decide`` for each deployment with a
policy and returns the snapshot with its ``replicas``/``warm_replicas`` replaced, plus the
decisions the shell stores (``deployment_autoscale``) and records (``reconcile_actions``).

Two deployments serving one model name both read that name's whole demand: each scales as if
it alone served it. This module must NOT do I/O or read a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from llmgw.planner.autoscale import (
    Decision,
    DemandSample,
    History,
    ScaleState,
    decide,
)
from llmgw.planner.replicas import serving
from llmgw.planner.snapshot import DeploymentId, Snapshot

__all__ = ["DemandHistory", "ModelSignal", "scale_snapshot"]

# Samples older than the longest window a policy may give (schemas.AutoscaleBody) are never
# read; the count bound holds memory even when passes come faster than the tick (NOTIFYs).
_KEEP_S = 3600.0
_KEEP_SAMPLES = 4096


@dataclass(frozen=True, slots=True)
class ModelSignal:
    """One model's demand over every gateway whose report is fresh (``store.demand``)."""

    gateways: int
    waiting_requests: int
    queued_prefill_tokens: int
    uncached_prefill_tokens: int
    in_flight: int
    held: int


class DemandHistory:
    """Recent demand samples per model name, oldest first."""

    def __init__(self, *, keep_s: float = _KEEP_S, keep_samples: int = _KEEP_SAMPLES) -> None:
        self._keep = timedelta(seconds=keep_s)
        self._samples: dict[str, deque[DemandSample]] = {}
        self._keep_samples = keep_samples

    def record(self, now: datetime, models: set[str], signals: Mapping[str, ModelSignal]) -> None:
        """A pass's reading for every model in ``models``; one without a fresh row was idle
        if another model's row is fresh (gateways report every routed model), else unknown."""
        any_fresh = any(s.gateways for s in signals.values())
        for name in models | set(signals):
            sig = signals.get(name)
            if sig is None:
                sample = DemandSample(at=now, gateways=1 if any_fresh else 0)
            else:
                sample = DemandSample(
                    at=now,
                    gateways=sig.gateways,
                    waiting_requests=sig.waiting_requests,
                    queued_prefill_tokens=sig.queued_prefill_tokens,
                    uncached_prefill_tokens=sig.uncached_prefill_tokens,
                    in_flight=sig.in_flight,
                    held=sig.held,
                )
            q = self._samples.setdefault(name, deque(maxlen=self._keep_samples))
            q.append(sample)
            while q and now - q[0].at > self._keep:
                q.popleft()
        for name in set(self._samples) - models - set(signals):
            del self._samples[name]

    def of(self, model: str) -> tuple[DemandSample, ...]:
        return tuple(self._samples.get(model, ()))

    def clear(self) -> None:
        """Forget everything: a leader that lost its lead saw a gap it cannot account for."""
        self._samples.clear()


def _frozen(reason: str, stalled: bool, broken: str | None) -> str:
    if broken:
        return f"profile cannot be launched: {broken}"
    if stalled:
        return f"rollout stalled: {reason}"
    return ""


def scale_snapshot(
    snapshot: Snapshot,
    *,
    history: DemandHistory,
    served: Mapping[DeploymentId, str],
    state: Mapping[DeploymentId, ScaleState],
    broken: Mapping[DeploymentId, str],
    now: datetime,
) -> tuple[Snapshot, dict[DeploymentId, Decision]]:
    """The snapshot with each autoscaled deployment's counts as decided now, and the
    decisions by deployment. A deployment suspended as a whole is not decided on."""
    decisions: dict[DeploymentId, Decision] = {}
    views = []
    ready: dict[DeploymentId, int] = {}
    for r in snapshot.replicas:
        if r.deployment_id is not None and serving(r):
            ready[r.deployment_id] = ready.get(r.deployment_id, 0) + 1
    for d in snapshot.deployments:
        st = state.get(d.id)
        if d.autoscale is None or st is None or d.suspended:
            views.append(d)
            continue
        st = replace(
            st,
            frozen=_frozen(d.status.reason, d.status.stalled, broken.get(d.id)),
            ready=ready.get(d.id, 0),
        )
        decision = decide(
            History(history.of(served.get(d.id, d.name)), st),
            d.autoscale,
            now,
            suspend_refusal=d.profile.suspend_refusal,
        )
        decisions[d.id] = decision
        views.append(replace(d, replicas=decision.desired, warm_replicas=decision.warm))
    return replace(snapshot, deployments=tuple(views)), decisions
