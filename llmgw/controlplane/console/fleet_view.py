"""What the console's pages (and `llmgw status`) show, computed from the admin API's JSON: the
rollout in words, GPUs per class, what needs attention first, the prefix hit rate per model,
and where each declared adapter stands (desired, placed and loaded replicas, failed loads).

Shared with `llmgw status` so the two screens never disagree about what "stalled" or "complete"
means. What it must NOT do: I/O, read clocks (``now`` is passed) or format HTML.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = [
    "ADAPTER_HOLDINGS_SHOWN",
    "STALE_SYNC_S",
    "AdapterHolding",
    "AdapterRow",
    "Attention",
    "adapter_failure_text",
    "adapter_rows",
    "attention",
    "gpus_per_class",
    "last_log_line",
    "node_state",
    "prefix_hit_rates",
    "rollout_text",
    "stopped_syncing",
    "suspended",
]

# A node that has not synced for this long stopped syncing (agents sync every ~2 s; the
# reconciler's own grace is longer): the console lists it under "needs attention" and
# `llmgw status` shows it as its STATE.
STALE_SYNC_S = 30.0

_DECISIONS = "llmgw_prefix_decisions"
# A shard restarted this often is shown as crash-looping even before the reconciler says so.
_CRASH_LOOP_RESTARTS = 3
_FAILING_STATES = frozenset({"failed", "unhealthy", "exited"})
# Replicas listed per adapter (failing ones first): with a page's other parts this keeps its
# HTML small however many replicas hold an adapter; the rest is counted, not shown.
ADAPTER_HOLDINGS_SHOWN = 8
# Failed loads one adapter's "needs attention" line names; the rest are counted.
_FAILURES_LISTED = 3
# An engine's (or a node policy's) answer to a load, as the console shows it at most.
_REASON_CHARS = 200
# The order a row lists its replicas in: what needs a look first.
_HOLDING_ORDER = {"failed": 0, "loading": 1, "unloading": 2, "loaded": 3}


def prefix_hit_rates(metrics_text: str) -> dict[str, dict[str, Any]]:
    """Per model: routing decisions, prefix hits and their share, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != _DECISIONS:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            model = sample.labels.get("model", "")
            row = out.setdefault(model, {"decisions": 0, "hits": 0, "precise": 0})
            row["decisions"] += int(sample.value)
            if sample.labels.get("outcome") == "hit":
                row["hits"] += int(sample.value)
            if sample.labels.get("method") == "precise":
                row["precise"] += int(sample.value)
    for row in out.values():
        row["hit_rate"] = round(row["hits"] / row["decisions"], 4) if row["decisions"] else None
    return out


def rollout_text(d: dict[str, Any]) -> str:
    """A deployment's rollout in words, from its admin API view (``status`` included)."""
    st = d.get("status") or {}
    desired = int(d.get("replicas") or 0)
    if d.get("state") == "suspended":
        return "suspended"
    if int(st.get("observed_generation") or 0) < int(d.get("generation") or 0):
        return "pending (the reconciler has not seen the latest change)"
    if st.get("stalled"):
        return "stalled"
    updated, ready = int(st.get("updated_replicas") or 0), int(st.get("ready_replicas") or 0)
    existing = int(st.get("replicas") or 0)
    if updated >= desired and ready >= desired and existing <= desired:
        return "complete"
    return f"progressing: {updated}/{desired} updated, {ready}/{desired} ready"


def suspended(d: dict[str, Any]) -> int | None:
    """How many of a deployment's replicas are suspended, when its status says (None: the
    admin API does not report it, which is not the same as none)."""
    value = (d.get("status") or {}).get("suspended_replicas")
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def gpus_per_class(node: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(GPU name, used, free) per distinct GPU name in a node's inventory, by name. The
    inventory lists names as NVML reports them; which class each matches is the placement's
    business, so the console shows the names the operator wrote the class patterns against."""
    held = int(node.get("num_gpus") or 0) - int(node.get("free_gpus") or 0)
    gpus = (node.get("inventory") or {}).get("gpus") or []
    counts: dict[str, int] = {}
    for g in gpus:
        name = str(g.get("name") or "?")
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        return []
    if len(counts) == 1:
        ((name, total),) = counts.items()
        return [(name, held, max(total - held, 0))]
    # Mixed nodes: the API counts used GPUs per node, not per name; show the totals honestly.
    return [(name, -1, total) for name, total in sorted(counts.items())]


@dataclass(frozen=True, slots=True)
class Attention:
    """One line of "what needs attention first"; ``rank`` orders them, lowest first."""

    rank: int
    what: str
    subject: str
    reason: str


def attention(
    nodes: list[dict[str, Any]],
    deployments: list[dict[str, Any]],
    replicas: list[dict[str, Any]],
    *,
    now: datetime,
    stale_sync_s: float,
    kv_not_whole: Mapping[str, str] | None = None,
    adapters: Sequence[AdapterRow] = (),
) -> list[Attention]:
    """Failing or crash-looping shards with their reason, stalled rollouts, adapters whose
    loads fail (one line each, ``adapters``: ``adapter_rows``), nodes that stopped syncing,
    shards whose KV view this instance holds only in part (``kv_not_whole``: shard id ->
    "partial" or "incomplete") and nodes waiting for approval, most urgent first."""
    out: list[Attention] = []
    kv_not_whole = kv_not_whole or {}
    for rep in replicas:
        for s in rep.get("shards") or []:
            if s.get("released"):
                continue
            state = str(s.get("observed_state") or "")
            restarts = int(s.get("restarts") or 0)
            subject = f"{rep.get('deployment') or '(deleted)'} shard {str(s.get('id'))[:8]} on {s.get('node')}"
            why = kv_not_whole.get(str(s.get("id")))
            if why is not None and state not in _FAILING_STATES:
                out.append(
                    Attention(
                        4, f"KV view {why}", subject,
                        "precise routing skips it (scored by the approximate tier) until its "
                        "agent sends a full copy"
                        + (" after losing events" if why == "partial" else ""),
                    )
                )  # fmt: skip
            if state in _FAILING_STATES:
                reason = str(s.get("reason") or "")
                said = last_log_line(str(s.get("log_tail") or ""))
                if said:
                    reason = f"{reason}; the engine said: {said}"
                out.append(Attention(0, f"shard {state}", subject, reason))
            elif restarts >= _CRASH_LOOP_RESTARTS:
                out.append(
                    Attention(
                        1, "crash-looping", subject, f"{restarts} restarts: {s.get('reason') or ''}"
                    )
                )
    for d in deployments:
        st = d.get("status") or {}
        if st.get("stalled"):
            out.append(Attention(2, "rollout stalled", str(d.get("name")), str(st.get("reason"))))
    for a in adapters:
        if a.failing:
            shown = [h for h in a.holdings if h.state == "failed"][:_FAILURES_LISTED]
            reason = "; ".join(adapter_failure_text(h.node, h.failures, h.reason) for h in shown)
            if a.failing > len(shown):
                reason += f"; and {a.failing - len(shown)} more"
            out.append(Attention(2, "adapter load failing", a.name, reason))
    for n in nodes:
        if n.get("approval_state") == "pending":
            out.append(
                Attention(5, "node pending approval", str(n.get("name")), "approve it on Nodes")
            )
            continue
        if stopped_syncing(n.get("last_sync_at"), now=now, stale_sync_s=stale_sync_s):
            last = _parse(n.get("last_sync_at"))
            ago = "never" if last is None else f"{(now - last).total_seconds():.0f}s ago"
            out.append(Attention(3, "node stopped syncing", str(n.get("name")), f"last sync {ago}"))
    return sorted(out, key=lambda a: a.rank)


def stopped_syncing(last_sync_at: Any, *, now: datetime, stale_sync_s: float) -> bool:
    """Whether a node whose last sync was at ``last_sync_at`` (the admin API's timestamp;
    None: never) stopped syncing by ``now``."""
    last = _parse(last_sync_at)
    return last is None or (now - last).total_seconds() > stale_sync_s


def node_state(
    *,
    approval: Any,
    cordoned: Any,
    draining: Any,
    last_sync_at: Any,
    now: datetime,
    stale_sync_s: float = STALE_SYNC_S,
) -> str:
    """A node's state in a word or two, most urgent first: as the console's "needs attention"
    judges it (a node silent for 1,000 s is not "ok" on one screen and stopped on the other)."""
    if approval == "pending":
        return "pending approval"
    if stopped_syncing(last_sync_at, now=now, stale_sync_s=stale_sync_s):
        return "stopped syncing"
    if draining:
        return "draining"
    if cordoned:
        return "cordoned"
    return "ok"


# Box-drawing frames some CLIs draw around their errors (typer, rich): not the message.
_FRAME = "│╭╮╰╯─┃━ \t"


def last_log_line(log_tail: str) -> str:
    """The engine's last non-empty log line, unframed, at most 200 characters: usually the
    error that ended it."""
    for line in reversed(log_tail.splitlines()):
        text = line.strip(_FRAME)
        if text:
            return text[:200]
    return ""


@dataclass(frozen=True, slots=True)
class AdapterHolding:
    """One replica an adapter is desired on or loaded in, and how that stands: ``loaded``
    (desired, and its agent reports it loaded), ``loading`` (desired, not reported loaded
    yet), ``failed`` (its agent reports the last load failed: ``reason``, ``failures`` in a
    row) or ``unloading`` (loaded, no longer desired there)."""

    replica: str
    node: str
    state: str
    reason: str = ""
    failures: int = 0

    @property
    def short(self) -> str:
        return self.replica[:8]


@dataclass(frozen=True, slots=True)
class AdapterRow:
    """A declared adapter as the console shows it. ``desired`` is the leader's count (None:
    not placed yet), ``placed`` the replicas told to hold it, ``loaded`` those whose agent
    reports it loaded (the three figures of `llmgw status`); ``holdings`` the first
    ``ADAPTER_HOLDINGS_SHOWN`` replicas by urgency, ``more_holdings`` the rest's count;
    ``why`` why it is short (the leader's words), or "not placed yet"."""

    name: str
    model: str
    min_replicas: int | None
    max_replicas: int | None
    pinned: bool
    desired: int | None
    placed: int
    loaded: int
    failing: int
    holdings: tuple[AdapterHolding, ...]
    more_holdings: int
    why: str

    @property
    def bounds(self) -> str:
        """``min..max``, "–" for a bound left at its default."""
        lo = "–" if self.min_replicas is None else str(self.min_replicas)
        hi = "–" if self.max_replicas is None else str(self.max_replicas)
        return f"{lo}..{hi}"


def adapter_failure_text(node: Any, failures: Any, reason: Any) -> str:
    """A failed load in `llmgw status`'s words: "load failed on NODE (Nx): REASON"."""
    return f"load failed on {node} ({failures}x): {reason}"


def _short_reason(text: Any) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= _REASON_CHARS else s[: _REASON_CHARS - 1] + "…"


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _holders(value: Any) -> list[dict[str, Any]]:
    return [h for h in value or [] if isinstance(h, dict) and h.get("replica")]


def _holdings(st: dict[str, Any]) -> list[AdapterHolding]:
    """Every replica an adapter's status names, once, with how it stands there: failed
    wherever its agent says so (desired there or not: the agent still reports it), else
    loaded, loading (desired, not loaded yet) or unloading (loaded, not desired there)."""
    placed = _holders(st.get("replicas"))
    loaded = {str(h["replica"]): h for h in _holders(st.get("loaded"))}
    failed = {str(f["replica"]): f for f in _holders(st.get("failures"))}
    placed_ids = {str(h["replica"]) for h in placed}
    out: list[AdapterHolding] = []
    seen: set[str] = set()
    for h in [*placed, *loaded.values(), *failed.values()]:
        rid = str(h["replica"])
        if rid in seen:
            continue
        seen.add(rid)
        if rid in failed:
            f = failed[rid]
            out.append(
                AdapterHolding(
                    rid, str(f.get("node") or h.get("node") or ""), "failed",
                    _short_reason(f.get("reason")), _int_or_none(f.get("failures")) or 0,
                )
            )  # fmt: skip
            continue
        if rid in placed_ids:
            holding = AdapterHolding(
                rid, str(h.get("node") or ""), "loaded" if rid in loaded else "loading"
            )
        else:
            holding = AdapterHolding(rid, str(h.get("node") or ""), "unloading")
        out.append(holding)
    # Stable: within a state, the API's order (by replica id).
    return sorted(out, key=lambda h: _HOLDING_ORDER[h.state])


def adapter_rows(items: list[dict[str, Any]]) -> list[AdapterRow]:
    """Each declared adapter from its admin API item (``GET /admin/v1/adapters``: the
    declaration and its read-only ``status``), in the API's order."""
    out: list[AdapterRow] = []
    for a in items:
        raw = a.get("status")
        st: dict[str, Any] = raw if isinstance(raw, dict) else {}
        holdings = _holdings(st)
        desired = _int_or_none(st.get("desired_replicas"))
        why = str(st.get("unplaced") or "")
        if desired is None and not why:
            why = "not placed yet"
        out.append(
            AdapterRow(
                name=str(a.get("name") or ""),
                model=str(a.get("model") or ""),
                min_replicas=_int_or_none(a.get("min_replicas")),
                max_replicas=_int_or_none(a.get("max_replicas")),
                pinned=bool(a.get("pinned")),
                desired=desired,
                placed=len(_holders(st.get("replicas"))),
                loaded=len(_holders(st.get("loaded"))),
                failing=len(_holders(st.get("failures"))),
                holdings=tuple(holdings[:ADAPTER_HOLDINGS_SHOWN]),
                more_holdings=max(len(holdings) - ADAPTER_HOLDINGS_SHOWN, 0),
                why=why,
            )
        )
    return out


def _parse(ts: Any) -> datetime | None:
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return None
