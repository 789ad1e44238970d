"""decide: a deployment's demand history and autoscale policy in, its desired replicas out.

The reconcile shell samples the gateways' demand (``gateway_demand``, summed over the fresh
rows of every gateway) once per pass, keeps the recent samples in memory, and asks ``decide``
how many replicas should serve (``desired``) and how many should stay placed (``warm``:
``desired`` plus suspended ones kept for a fast wake). ``compute_plan`` then converges on those
counts exactly as it does on an operator's ``replicas``. Rules, in the order they apply:

- frozen: a stalled rollout or a profile the engines refuse changes nothing (scaling a
  deployment that cannot make progress would only add replicas that cannot start);
- bounds: below ``min_replicas`` or above ``max_replicas`` (a policy edit) is corrected at once;
- wake: requests held for a deployment at zero serving replicas start (or resume) one at once,
  with no window: the client waits for it (scale from zero);
- idle: no request held, queued or in flight for ``zero_after_s`` stops every replica above
  ``min_replicas``; for ``suspend_after_s``, it suspends them (kept placed, engine asleep);
  a suspended replica is stopped once it has been idle ``zero_after_s`` in all, even if the
  deployment came back to life meanwhile with fewer replicas. Where the profile's engine
  cannot suspend (``suspend_refusal``: vLLM without sleep mode, or on the CPU, where its sleep
  mode does not exist), ``suspend_after_s`` stops them instead, and the reason says why: a
  placement kept for an engine whose agent stops it would hold GPUs or CPU threads that serve
  nobody, and its wake is a cold start either way;
- up: the recommendation (backlog / target per replica, the largest of the targets given)
  stayed above the serving count for the whole ``scale_up_window_s``; one step per window, at
  most doubling (HPA's default scale-up policy), and none while the last step's replicas are
  not all serving (a cold start lets the backlog grow; stepping on it again overshoots): a
  spike of one scrape never buys a fleet;
- down: the recommendation at ``_DOWN_FILL`` of the target stayed below the serving count for
  the whole ``scale_down_window_s`` (the gap between the two fills is the hysteresis band).
  With ``suspend_after_s`` or ``zero_after_s`` set, this rule stops at one replica: the last
  goes only through the idle rule.

A window needs evidence: up and down act only when the history spans the window and, for
down, every sample in it is known (a pass with no fresh gateway report knows nothing, and
silence must never read as idleness). After a leader change the history starts empty, so the
new leader waits one window before moving with the windows; wake and bounds act at once.

This module must NOT do I/O or read a clock: the shell passes ``now`` and the samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "AutoscalePolicy",
    "Decision",
    "DemandSample",
    "History",
    "ScaleState",
    "decide",
    "format_tokens",
]

# Scale down only to a count that would run at this share of the target or less: between
# it and 1.0 nothing moves, so a load right at the target does not flap.
_DOWN_FILL = 0.8


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    """A deployment's ``autoscale:`` mapping (validated at the admin API)."""

    min_replicas: int
    max_replicas: int
    # Per serving replica: prefill tokens waiting to be computed that the prefix caches do
    # not hold (queued at the gateways or sent but not past their prefill). None: not a target.
    target_queued_prefill_tokens: int | None = None
    # Per serving replica: requests not yet running (gateway queues, held, engine queues).
    target_waiting_requests: float | None = None
    scale_up_window_s: float = 30.0
    scale_down_window_s: float = 300.0
    # Idle this long: replicas above min suspended (None: never suspended).
    suspend_after_s: float | None = None
    # Idle this long: replicas above min stopped (None: only the down rule removes them).
    zero_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class DemandSample:
    """The gateways' demand for one deployment's model at one pass, summed over gateways."""

    at: datetime
    # Gateways whose report was fresh; 0: nothing is known of this moment.
    gateways: int
    waiting_requests: int = 0
    queued_prefill_tokens: int = 0
    uncached_prefill_tokens: int = 0
    in_flight: int = 0
    # Requests waiting at a gateway for a model with no ready replica.
    held: int = 0

    @property
    def known(self) -> bool:
        return self.gateways > 0

    @property
    def active(self) -> bool:
        return self.in_flight + self.waiting_requests + self.held > 0


@dataclass(frozen=True, slots=True)
class ScaleState:
    """What the last decision left (``deployment_autoscale``), as the leader stored it."""

    desired: int
    warm: int
    last_scaled_at: datetime | None = None
    idle_since: datetime | None = None
    # Since when replicas above `desired` are suspended (None: none is).
    suspended_since: datetime | None = None
    # Replicas serving now (the shell counts them); None: unknown, nothing waits on it.
    ready: int | None = None
    # Why scaling is frozen now ("" = it is not): set by the shell from the rollout status.
    frozen: str = ""


@dataclass(frozen=True, slots=True)
class History:
    samples: tuple[DemandSample, ...]  # oldest first
    state: ScaleState


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    warm: int
    idle_since: datetime | None
    reason: str
    # A replica count changed: the shell records the reason in reconcile_actions.
    changed: bool
    # Set when this decision moved a count (the time the next window counts from).
    last_scaled_at: datetime | None = None
    suspended_since: datetime | None = None


def format_tokens(n: float) -> str:
    """38000 -> "38k", 8192 -> "8.2k", 900 -> "900": the scale of a reason, not its digits."""
    if n >= 1000:
        k = n / 1000
        return f"{k:.0f}k" if k >= 10 or k == int(k) else f"{k:.1f}k"
    return f"{n:.0f}"


def _need(s: DemandSample, p: AutoscalePolicy, fill: float) -> int:
    """Replicas the sample's backlog asks for at ``fill`` of each target; 1 while anything is
    active (a request in flight needs a replica whatever the targets say)."""
    need = 0
    if p.target_queued_prefill_tokens:
        need = max(
            need, math.ceil(s.uncached_prefill_tokens / (p.target_queued_prefill_tokens * fill))
        )
    if p.target_waiting_requests:
        need = max(need, math.ceil(s.waiting_requests / (p.target_waiting_requests * fill)))
    if s.active:
        need = max(need, 1)
    return need


def _clamp(n: int, p: AutoscalePolicy) -> int:
    return max(p.min_replicas, min(p.max_replicas, n))


def _window(samples: Sequence[DemandSample], now: datetime, window_s: float) -> list[DemandSample]:
    """The samples in (now - window, now], or the latest one for a window of 0; empty when
    the history does not reach back to the window's start (not enough evidence yet)."""
    if not samples:
        return []
    if window_s <= 0:
        return [samples[-1]]
    if (now - samples[0].at).total_seconds() < window_s:
        return []
    return [s for s in samples if (now - s.at).total_seconds() <= window_s]


def _idle_since(h: History) -> datetime | None:
    """When the deployment last became idle (nothing held, queued or in flight), judged on
    known samples only; the stored value carries it across passes and leaders."""
    since = h.state.idle_since
    for s in h.samples:
        if not s.known:
            continue
        if s.active:
            since = None
        elif since is None:
            since = s.at
    return since


def _why(s: DemandSample, p: AutoscalePolicy, serving: int, *, up: bool) -> str:
    """The signal that moved the count, per serving replica, against its target."""
    per = max(serving, 1)
    parts = []
    op = ">" if up else "<"
    if p.target_queued_prefill_tokens:
        parts.append(
            f"queued prefill {format_tokens(s.uncached_prefill_tokens / per)} tokens/replica "
            f"{op} target {format_tokens(p.target_queued_prefill_tokens)}"
        )
    if p.target_waiting_requests:
        parts.append(
            f"waiting {s.waiting_requests / per:.1f} requests/replica {op} target "
            f"{p.target_waiting_requests:g}"
        )
    return " and ".join(parts) if parts else f"{s.in_flight} requests in flight"


def decide(
    history: History, policy: AutoscalePolicy, now: datetime, *, suspend_refusal: str = ""
) -> Decision:
    """The deployment's desired (serving) and warm (placed) replica counts at ``now``.

    ``suspend_refusal``: why the profile's engine cannot suspend (``Engine.suspend_refusal``);
    "" when it can."""
    p = policy
    st = history.state
    samples = history.samples
    desired, warm = st.desired, max(st.warm, st.desired)
    idle_since = _idle_since(history)
    latest = next((s for s in reversed(samples) if s.known), None)

    def result(n: int, w: int, reason: str) -> Decision:
        w = max(w, n)
        changed = (n, w) != (st.desired, max(st.warm, st.desired))
        # Since when replicas are suspended: set as the first is, kept while any stays.
        asleep: datetime | None = None
        if w > n:
            asleep = st.suspended_since if warm > desired and st.suspended_since else now
        return Decision(
            n,
            w,
            idle_since,
            reason,
            changed,
            now if changed else st.last_scaled_at,
            suspended_since=asleep,
        )

    def scaled(n: int, w: int, why: str) -> Decision:
        return result(n, w, f"scaled {desired}\u2192{n}: {why}")

    if st.frozen:
        return result(desired, warm, f"scaling frozen: {st.frozen}")
    if desired < p.min_replicas or desired > p.max_replicas:
        n = _clamp(desired, p)
        return scaled(
            n,
            max(warm, n) if n > desired else n,
            f"policy bounds {p.min_replicas}..{p.max_replicas}",
        )
    if desired == 0 and latest is not None and latest.active and p.max_replicas > 0:
        what = f"{latest.held} requests held" if latest.held else "demand"
        return scaled(1, warm, f"woken: {what} with no ready replica")
    idle_s = None if idle_since is None else (now - idle_since).total_seconds()
    if idle_s is not None and desired > p.min_replicas:
        if p.zero_after_s is not None and idle_s >= p.zero_after_s:
            return scaled(
                p.min_replicas,
                p.min_replicas,
                f"idle for {idle_s:.0f} s \u2265 zero_after_s {p.zero_after_s:g}",
            )
        if p.suspend_after_s is not None and idle_s >= p.suspend_after_s:
            idle = f"idle for {idle_s:.0f} s \u2265 suspend_after_s {p.suspend_after_s:g}"
            if suspend_refusal:
                return scaled(
                    p.min_replicas,
                    p.min_replicas,
                    f"stopped, not suspended ({suspend_refusal}): {idle}",
                )
            return scaled(p.min_replicas, warm, f"suspended: {idle}")
    if suspend_refusal and warm > desired:
        # Suspended before its profile lost the ability (an edit): their engines are stopped,
        # so nothing is gained by keeping them placed.
        return result(
            desired,
            desired,
            f"stopped {warm - desired} suspended replicas: they cannot suspend ({suspend_refusal})",
        )
    if warm > desired and p.zero_after_s is not None and st.suspended_since is not None:
        # A suspended replica is an idle one: it was idle suspend_after_s when suspended, so
        # it stops zero_after_s - suspend_after_s later, whether or not the deployment is
        # idle now (a trickle keeping one replica busy must not keep seven asleep forever).
        asleep_s = (now - st.suspended_since).total_seconds()
        if asleep_s >= p.zero_after_s - (p.suspend_after_s or 0.0):
            return result(
                desired,
                desired,
                f"stopped {warm - desired} suspended replicas: idle for "
                f"{asleep_s + (p.suspend_after_s or 0.0):.0f} s \u2265 zero_after_s "
                f"{p.zero_after_s:g}",
            )

    def settled(window_s: float) -> bool:
        return st.last_scaled_at is None or (now - st.last_scaled_at).total_seconds() >= window_s

    up = _window(samples, now, p.scale_up_window_s)
    up_known = [s for s in up if s.known]
    if up_known and settled(p.scale_up_window_s):
        need = min(_need(s, p, 1.0) for s in up_known)
        if need > desired and st.ready is not None and st.ready < desired:
            # The last step is not serving yet: its backlog is what it was added for, and
            # stepping again on it would buy replicas for a queue a start is about to drain.
            return result(desired, warm, "")
        if need > desired:
            n = min(need, desired + max(1, desired), p.max_replicas)
            if n > desired:
                window = f" for {p.scale_up_window_s:g} s" if p.scale_up_window_s > 0 else ""
                return scaled(n, warm, f"{_why(up_known[-1], p, desired, up=True)}{window}")
    down = _window(samples, now, p.scale_down_window_s)
    if down and all(s.known for s in down) and settled(p.scale_down_window_s):
        floor = p.min_replicas
        if p.suspend_after_s is not None or p.zero_after_s is not None:
            floor = max(floor, 1)  # the last replica goes only through the idle rule
        need = max(max(_need(s, p, _DOWN_FILL) for s in down), floor)
        if need < desired:
            n = _clamp(need, p)
            return scaled(
                n,
                n + (warm - desired),
                f"{_why(down[-1], p, desired, up=False)} for {p.scale_down_window_s:g} s",
            )
    return result(desired, warm, "")
