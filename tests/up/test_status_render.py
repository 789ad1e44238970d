"""`llmgw status`'s pure parts: the hit rate read from Prometheus text, and the screen."""

from __future__ import annotations

from typing import Any

from llmgw.commands.status import prefix_hit_rates, render

_METRICS = """\
# HELP llmgw_prefix_decisions_total Routing decisions by method and outcome.
# TYPE llmgw_prefix_decisions_total counter
llmgw_prefix_decisions_total{method="precise",model="demo",outcome="hit"} 6.0
llmgw_prefix_decisions_total{method="precise",model="demo",outcome="miss"} 2.0
llmgw_prefix_decisions_total{method="approximate",model="demo",outcome="miss"} 2.0
llmgw_prefix_decisions_total{method="least_loaded",model="other",outcome="none"} 3.0
# HELP llmgw_prefix_decisions_created Routing decisions by method and outcome.
# TYPE llmgw_prefix_decisions_created gauge
llmgw_prefix_decisions_created{method="precise",model="demo",outcome="hit"} 1.7e9
"""


def test_hit_rate_per_model_from_the_decisions_counter() -> None:
    rates = prefix_hit_rates(_METRICS)
    assert rates["demo"] == {"decisions": 10, "hits": 6, "precise": 8, "hit_rate": 0.6}
    assert rates["other"] == {"decisions": 3, "hits": 0, "precise": 0, "hit_rate": 0.0}
    assert prefix_hit_rates("# nothing\n") == {}


def _data(rates: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "name": "gpu-1",
                "approval": "approved",
                "pool": "default",
                "gpus": 8,
                "free_gpus": 6,
                "shards": 2,
                "cordoned": False,
                "draining": False,
                "last_sync_at": None,
            }
        ],
        "deployments": [
            {
                "name": "demo",
                "model": "demo",
                "desired": 2,
                "ready": 1,
                "updated": 2,
                "rollout": "progressing: 2/2 updated, 1/2 ready",
                "reason": "",
            }
        ],
        "shards": [
            {
                "deployment": "demo",
                "replica": "0f3c9a2e-aaaa",
                "replica_state": "active",
                "stale": False,
                "rank": 0,
                "node": "gpu-1",
                "gpus": [3],
                "desired_state": "running",
                "state": "failed",
                "reason": "exit 1: CUDA out of memory",
                "restarts": 4,
            }
        ],
        "prefix_routing": rates,
    }


def test_the_screen_names_what_is_wrong_and_where() -> None:
    screen = render(_data({"demo": {"decisions": 10, "hits": 6, "precise": 8, "hit_rate": 0.6}}))
    assert "progressing: 2/2 updated, 1/2 ready" in screen
    assert "6/8" in screen and "never" in screen
    assert "failed" in screen and "CUDA out of memory" in screen and "gpu-1" in screen
    assert "60.0%" in screen
    assert "n/a" in render(_data(None))
    assert "no requests routed yet" in render(_data({}))


def test_the_screen_says_how_each_model_is_tokenized() -> None:
    from llmgw.commands.status import tokenizer_modes

    text = (
        "# TYPE llmgw_prefix_tokenizer_mode gauge\n"
        'llmgw_prefix_tokenizer_mode{mode="local",model="demo"} 1.0\n'
        'llmgw_prefix_tokenizer_mode{mode="remote",model="demo"} 0.0\n'
        'llmgw_prefix_tokenizer_mode{mode="local",model="other"} 0.0\n'
        'llmgw_prefix_tokenizer_mode{mode="remote",model="other"} 1.0\n'
        "# TYPE llmgw_prefix_tokenizer_mismatches counter\n"
        'llmgw_prefix_tokenizer_mismatches_total{model="other"} 1.0\n'
    )
    assert tokenizer_modes(text) == {"demo": "local", "other": "remote (mismatch)"}
    # A profile's `tokenizer: none` is the reason shown, before an old mismatch.
    by_profile = (
        text
        + "# TYPE llmgw_prefix_tokenizer_profile_none gauge\n"
        + 'llmgw_prefix_tokenizer_profile_none{model="demo"} 0.0\n'
        + 'llmgw_prefix_tokenizer_profile_none{model="other"} 1.0\n'
    )
    assert tokenizer_modes(by_profile) == {"demo": "local", "other": "remote (profile)"}
    row = {"decisions": 1, "hits": 1, "precise": 1, "hit_rate": 1.0, "tokenizer": "local"}
    screen = render(_data({"demo": row}))
    assert "TOKENIZING" in screen and "local" in screen


def test_an_autoscaled_deployment_shows_its_decision_and_held_requests() -> None:
    data = _data({})
    data["deployments"].append(
        {
            "name": "chat",
            "model": "chat",
            "desired": 1,
            "ready": 0,
            "updated": 0,
            "rollout": "progressing",
            "reason": "",
            "suspended": 2,
            "autoscale": {
                "min": 0,
                "max": 4,
                "desired": 1,
                "warm": 3,
                "last_scaled_at": None,
                "reason": "scaled 0\u21921: woken: 3 requests held with no ready replica",
            },
        }
    )
    data["demand"] = [
        {
            "model": "chat",
            "queued": 3,
            "held": 3,
            "in_flight": 0,
            "shed": 0,
            "queued_prefill_tokens": 1200,
            "uncached_prefill_tokens": 900,
            "saturated": True,
            "saturated_since": None,
        },
    ]
    screen = render(data)
    assert "AUTOSCALING (1)" in screen
    row = next(line for line in screen.splitlines() if line.startswith("chat ") and "0..4" in line)
    assert row.split()[:6] == ["chat", "0..4", "1", "0", "2", "3"]
    assert "woken: 3 requests held" in screen
    assert "UNCACHED" in screen and "900" in screen


def test_runtime_adapters_show_desired_and_loaded_replicas_and_why_one_is_short() -> None:
    data = _data({})
    assert "ADAPTERS" not in render(data)  # none declared, or an older control plane
    data["adapters"] = [
        {
            "name": "sql",
            "model": "demo",
            "desired": 2,
            "replicas": 2,
            "loaded": 1,
            "unplaced": "",
            "failures": [
                {"replica": "r-2", "node": "gpu-2", "reason": "no such dir", "failures": 3}
            ],
        },
        {
            "name": "chat",
            "model": "demo",
            "desired": None,
            "replicas": 0,
            "loaded": 0,
            "unplaced": "no profile of model demo holds adapters at runtime",
            "failures": [],
        },
    ]
    lines = render(data).splitlines()
    at = lines.index("ADAPTERS (2)")
    assert lines[at + 1].split() == ["NAME", "MODEL", "DESIRED", "PLACED", "LOADED", "REASON"]
    sql, chat = lines[at + 2], lines[at + 3]
    assert sql.split()[:5] == ["sql", "demo", "2", "2", "1"]
    assert sql.endswith("load failed on gpu-2 (3x): no such dir")
    assert chat.split()[:5] == ["chat", "demo", "-", "0", "0"]
    assert chat.endswith("no profile of model demo holds adapters at runtime")
