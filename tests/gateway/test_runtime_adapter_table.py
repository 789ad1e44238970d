"""Runtime LoRA adapters in the route table (issue [lora], "Routing"), pure: a declared adapter
(``kind: adapter``) routes only to its base's ready replicas whose engine reports it loaded;
it is blocked (held requests answered at once) only when every replica the leader chose
reports its load failed, or no profile of the base has adapter slots; static adapters keep
routing as before, beside runtime ones on one endpoint; precise routing hashes a runtime
adapter's prompt with its name and path as vLLM does; a 404 names the adapters a key may have
meant."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from structlog.testing import capture_logs

from llmgw.gateway.routes import AdapterRow, DeclaredRow, Endpoint, RouteRow, build_table
from llmgw.gateway.routing.inputs import index_shares
from llmgw.gateway.routing.router import Candidate
from llmgw.gateway.runtime_adapters import AdapterBlocked, unknown_model_hint
from llmgw.kv import PrefixIndex
from llmgw.kv.hashing import block_hashes, hash64
from llmgw.store.routes import ObservedAdapter

X = AdapterRow("x", "m", "/adapters/x")
KV_HASH = {"seed": "9", "block_size": 4, "extra_key_format": "tagged"}


def _row(
    replica: str,
    *observed: tuple[str, str, str],
    desired: tuple[str, ...] = (),
    ready: bool = True,
    slots: int = 4,
    **profile: Any,
) -> RouteRow:
    spec = {"name": "p", "engine": "sim", "model": "m", "served_model_name": ""}
    spec.update(profile)
    return RouteRow(
        shard=f"s-{replica}",
        replica=replica,
        proxy_url=f"http://agent/shards/s-{replica}",
        api_key="k",
        ready=ready,
        index_model="m",
        profile=spec,
        desired_adapters=frozenset(desired),
        observed_adapters=tuple(ObservedAdapter(n, st, why) for n, st, why in observed),
        adapter_slots=slots,
    )


def _replicas(eps: tuple[Endpoint, ...]) -> list[str]:
    return [e.replica for e in eps]


def test_only_replicas_that_report_the_adapter_loaded_serve_it() -> None:
    rows = [
        _row("r1", ("x", "loaded", ""), desired=("x",)),
        _row("r2", ("x", "loading", ""), desired=("x",)),
        _row("r3", ("x", "failed", "No adapter found for /adapters/x"), desired=("x",)),
        _row("r4", ("x", "unloading", "")),
        _row("r5", ("x", "loaded", ""), ready=False),  # loaded, but the replica is not ready
        _row("r6"),
    ]
    table = build_table(rows, read_at=1.0, adapters=[X])
    x = table.routes["x"]
    assert (x.name, x.base, x.lora, x.runtime) == ("x", "m", ("x", "/adapters/x"), True)
    assert _replicas(x.endpoints) == ["r1"]
    assert x.adapter_blocked is None and x.wake_blocked == ""
    # The base model's route is as it was: every ready replica.
    m = table.routes["m"]
    assert (m.lora, m.runtime, _replicas(m.endpoints)) == (
        None,
        False,
        ["r1", "r2", "r3", "r4", "r6"],
    )
    assert table.adapters == {"x": "m"}


def test_loaded_nowhere_it_is_held_until_every_chosen_replica_failed() -> None:
    failed = ("x", "failed", "Loading lora x failed: No adapter found for /adapters/x")
    # Placed on r1 and r2; r2 has not reported yet: it may still load.
    pending = build_table(
        [_row("r1", failed, desired=("x",)), _row("r2", desired=("x",))], read_at=1.0, adapters=[X]
    ).routes["x"]
    assert pending.endpoints == () and pending.wakeable and pending.adapter_blocked is None
    loading = build_table(
        [_row("r1", failed, desired=("x",)), _row("r2", ("x", "loading", ""), desired=("x",))],
        read_at=1.0,
        adapters=[X],
    ).routes["x"]
    assert loading.adapter_blocked is None
    # Not placed yet (the leader's next pass places it): held, nothing against it.
    unplaced = build_table([_row("r1"), _row("r2")], read_at=1.0, adapters=[X]).routes["x"]
    assert unplaced.wakeable and unplaced.adapter_blocked is None
    # Every replica the leader chose failed: blocked, naming the first and the engine's reason.
    both = build_table(
        [_row("r2", failed, desired=("x",)), _row("r1", failed, desired=("x",)), _row("r3")],
        read_at=1.0,
        adapters=[X],
    ).routes["x"]
    assert both.adapter_blocked == AdapterBlocked(
        "adapter_load_failed",
        "adapter 'x' failed to load on replica r1: Loading lora x failed: No adapter found for "
        "/adapters/x (and on 1 other replica); fix its path (`llmgw get adapters x`)",
    )
    # The leader chose none (it took the adapter back after the failures): the replicas that
    # report it are the ones that tried.
    gave_up = build_table([_row("r1", failed), _row("r2")], read_at=1.0, adapters=[X])
    blocked = gave_up.routes["x"].adapter_blocked
    assert blocked is not None and blocked.message.startswith(
        "adapter 'x' failed to load on replica r1: "
    )


def test_a_base_without_adapter_slots_blocks_its_adapters_at_once() -> None:
    table = build_table(
        [_row("r1", slots=0)], read_at=1.0, declared=[DeclaredRow("m", model="m")], adapters=[X]
    )
    assert table.routes["x"].adapter_blocked == AdapterBlocked(
        "adapter_unplaceable",
        "adapter 'x' cannot be loaded: no replica of model 'm' may hold runtime adapters "
        "(adapter_slots is 0 on its profiles); set adapter_slots on its profile "
        "(`llmgw get profiles`), then retry",
    )
    # The deployment's profile has slots (its replicas roll to it): placeable.
    rolling = build_table(
        [_row("r1", slots=0)],
        read_at=1.0,
        declared=[DeclaredRow("m", model="m", adapter_slots=2)],
        adapters=[X],
    )
    assert rolling.routes["x"].adapter_blocked is None


def test_static_and_runtime_adapters_share_an_endpoint() -> None:
    rows = [
        _row(
            "r1",
            ("x", "loaded", ""),
            ("gone", "loaded", ""),  # no longer declared: the agent unloads it, nothing routes
            adapters=[{"name": "sql", "path": "/static/sql"}],
        ),
        _row("r2", adapters=[{"name": "sql", "path": "/static/sql"}]),
    ]
    table = build_table(rows, read_at=1.0, adapters=[X])
    r1 = table.routes["m"].endpoints[0]
    assert dict(r1.adapters) == {"sql": "/static/sql", "x": "/adapters/x"}
    assert dict(table.routes["m"].endpoints[1].adapters) == {"sql": "/static/sql"}
    sql, x = table.routes["sql"], table.routes["x"]
    assert (sql.lora, sql.runtime, _replicas(sql.endpoints)) == (
        ("sql", "/static/sql"),
        False,
        ["r1", "r2"],
    )
    assert (x.lora, x.runtime, _replicas(x.endpoints)) == (("x", "/adapters/x"), True, ["r1"])
    assert "gone" not in table.routes
    assert table.adapters == {"sql": "m", "x": "m"}


def test_a_name_both_static_and_declared_keeps_the_static_route() -> None:
    rows = [_row("r1", ("sql", "loaded", ""), adapters=[{"name": "sql", "path": "/static/sql"}])]
    with capture_logs() as logs:
        table = build_table(rows, read_at=1.0, adapters=[AdapterRow("sql", "m", "/declared/sql")])
    sql = table.routes["sql"]
    assert (sql.lora, sql.runtime) == (("sql", "/static/sql"), False)
    # The launched path, which the engine hashes with: never the declaration's.
    assert dict(sql.endpoints[0].adapters) == {"sql": "/static/sql"}
    assert {
        "event": "gateway_name_conflict",
        "name": "sql",
        "kept": "static adapter",
        "dropped": "declared adapter",
        "log_level": "warning",
    } in logs


def test_an_adapter_of_a_model_nobody_routes_is_unknown() -> None:
    table = build_table([_row("r1")], read_at=1.0, adapters=[AdapterRow("z-sql", "z", "/a")])
    assert "z-sql" not in table.routes and "z" not in table.routes
    assert table.adapters == {}


def test_the_base_is_the_route_its_model_is_served_as() -> None:
    # A profile with a served_model_name: the adapter names the model, clients the served name.
    rows = [_row("r1", ("x", "loaded", ""), served_model_name="m-chat")]
    table = build_table(rows, read_at=1.0, adapters=[X])
    assert table.routes["x"].base == "m-chat"
    assert _replicas(table.routes["x"].endpoints) == ["r1"]


@pytest.mark.parametrize(
    ("autoscaled", "ready", "wakeable"),
    [
        (False, True, True),  # held while placed on a serving replica
        (True, False, True),  # held while its base wakes from zero, then placed
        (False, False, False),  # nothing serves the base and nothing wakes it: 503 at once
    ],
)
def test_an_adapter_is_held_where_its_base_serves_or_wakes(
    autoscaled: bool, ready: bool, wakeable: bool
) -> None:
    declared = [DeclaredRow("m", autoscaled=autoscaled, model="m", adapter_slots=1)]
    table = build_table([_row("r1", ready=ready)], read_at=1.0, declared=declared, adapters=[X])
    assert table.routes["x"].wakeable is wakeable


def test_the_bases_wake_trouble_blocks_its_adapters_only_while_it_has_no_ready_replica() -> None:
    declared = DeclaredRow("m", autoscaled=True, model="m", adapter_slots=1, crash_reason="OOM")
    at_zero = build_table([], read_at=1.0, declared=[declared], adapters=[X])
    assert at_zero.routes["x"].wake_blocked == at_zero.routes["m"].wake_blocked != ""
    serving = build_table([_row("r1")], read_at=1.0, declared=[declared], adapters=[X])
    assert serving.routes["x"].wake_blocked == ""


def test_precise_routing_hashes_a_runtime_adapters_prompt_with_its_name_and_path() -> None:
    """vLLM (tagged extra keys) hashes ("lora", name, path) into every block of an adapter's
    request: the route's lora must be the runtime adapter's, or every replica scores 0."""
    rows = [
        _row("r1", ("x", "loaded", ""), kv_events=True, kv_hash=KV_HASH),
        _row("r2", ("x", "loaded", ""), kv_events=True, kv_hash=KV_HASH),
    ]
    x = build_table(rows, read_at=1.0, adapters=[X]).routes["x"]
    prompt = list(range(1, 18))  # 4 scorable blocks of 4

    def stored(lora: tuple[str, str] | None) -> list[int]:
        name, path = lora if lora is not None else (None, None)
        digests = block_hashes(prompt, 4, seed="9", lora_name=name, lora_path=path)
        return [hash64(d) for d in digests]

    class View:
        index = PrefixIndex()

        def is_complete(self, shard_id: str) -> bool:
            return True

    view = View()
    view.index.apply_snapshot("m", "s-r1", {"gpu": stored(x.lora)})
    view.index.apply_snapshot("m", "s-r2", {"gpu": stored(None)})  # the base model's blocks
    cands = [Candidate(ep.replica, ep.shard, 0) for ep in x.endpoints]
    shares = index_shares(view, x.endpoints, cands, prompt, salt=None, lora=x.lora)
    assert shares == {"r1": 1.0, "r2": 0.0}


# --- the 404's hint --------------------------------------------------------------------------

ADAPTERS = {"m-sql": "m", "m-chat": "m", "m-law": "m", "n-sql": "n", "secret": "m"}


def _anyone(name: str) -> bool:
    return True


@pytest.mark.parametrize(
    ("name", "usable", "hint"),
    [
        # Its base's name then a separator: that base's adapters.
        ("m-sqll", _anyone, "adapters of 'm' this key may use: m-chat, m-law, m-sql, secret"),
        ("n/legal", _anyone, "adapters of 'n' this key may use: n-sql"),
        # A typo of an adapter's name.
        ("nsql", _anyone, "adapters of 'n' this key may use: n-sql"),
        ("m-chta", _anyone, "adapters of 'm' this key may use: m-chat, m-law, m-sql, secret"),
        ("msql", _anyone, "adapters of 'm' this key may use: m-sql"),
        ("x-sql", _anyone, "adapters of 'm', 'n' this key may use: m-sql, n-sql"),
        # Never a name the key may not use.
        (
            "m-sqll",
            lambda n: n != "secret",
            "adapters of 'm' this key may use: m-chat, m-law, m-sql",
        ),
        # Nothing like an adapter request: the 404 as before.
        ("llama-70b", _anyone, ""),
        ("m-sqll", lambda n: False, ""),
        ("m-" + "q" * 300, _anyone, ""),
    ],
)
def test_an_unknown_name_that_reads_like_an_adapter_request_lists_adapters(
    name: str, usable: Any, hint: str
) -> None:
    assert unknown_model_hint(name, ADAPTERS, usable) == hint


def test_the_hint_is_bounded() -> None:
    many = {f"m-a{i:02}": "m" for i in range(12)}
    assert unknown_model_hint("m-zz", many, _anyone) == (
        "adapters of 'm' this key may use: m-a00, m-a01, m-a02, m-a03, m-a04 (and 7 more)"
    )


def test_rows_without_runtime_adapters_build_the_table_as_before() -> None:
    # A row of a release before runtime adapters: nothing observed, nothing desired.
    row = replace(_row("r1"), observed_adapters=(), desired_adapters=frozenset())
    table = build_table([row], read_at=1.0)
    assert set(table.routes) == {"m"} and table.adapters == {}
