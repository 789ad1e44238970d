"""Placement table tests: where a replica goes, and the exact explanation when it goes nowhere."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from llmgw.engines import Profile as EngineProfile
from llmgw.engines import placement_requirements
from llmgw.errors import PlacementError
from llmgw.planner import (
    GPU,
    Capacity,
    DeploymentId,
    NodeId,
    NodeView,
    Placement,
    PlacementRequest,
    PlanSettings,
    ReplicaId,
    ReplicaView,
    ShardId,
    ShardView,
    Unplaceable,
    place_replica,
)
from tests.planner.planner_testkit import SETTINGS, T0, node, requirements, snapshot


def _req(
    engine: str = "vllm", deployment: str = "d", pool: str = "default", **kw: object
) -> PlacementRequest:
    reqs = requirements(**kw)  # type: ignore[arg-type]
    return PlacementRequest(DeploymentId(deployment), pool, reqs.gpu_class, engine, reqs)


def _cap(
    nodes: list[NodeView], replicas: tuple[ReplicaView, ...] = (), settings: PlanSettings = SETTINGS
) -> Capacity:
    return Capacity(snapshot([], nodes, replicas, settings), T0)


def _placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result
    return result


def _failed(result: Placement | Unplaceable) -> Unplaceable:
    assert isinstance(result, Unplaceable), result
    return result


def _holding(node_id: str, keys: tuple[str, ...], port: int | None = None) -> ReplicaView:
    shard = ShardView(
        ShardId(f"s-{node_id}-{keys}"), ReplicaId(f"r-{node_id}-{keys}"), NodeId(node_id), 0,
        gpu_keys=keys, leader_port=port,
    )  # fmt: skip
    return ReplicaView(ReplicaId(f"r-{node_id}-{keys}"), DeploymentId("other"), "fp", T0, (shard,))


def test_single_node_explanation_names_every_node_and_its_reason() -> None:
    nodes = [
        node("a", cordoned=True),
        node("b", 3),
        node("c", pool="batch"),
        node("d", synced=None),
        node("e", approved=False),
        node("f", draining=True),
        node("g", synced=T0 - timedelta(minutes=5)),
    ]
    result = _failed(place_replica(_req(gpus=8), _cap(nodes)))
    assert result.explain() == (
        "needs 1 node with 8 free h100 GPUs in pool default; no node has them; "
        "a: cordoned; b: 3 free h100 GPUs, needs 8; c: in pool batch, not default; "
        "d: never synced; e: pending approval (llmgw nodes approve e); f: draining; "
        "g: not syncing"
    )
    err = result.error()
    assert isinstance(err, PlacementError)
    assert err.code == "placement-failed"
    assert err.reasons["b"] == "3 free h100 GPUs, needs 8"
    assert set(err.reasons) == set("abcdefg")


def test_explanation_groups_many_nodes_with_one_reason() -> None:
    nodes = [node(f"n{i}", cordoned=True) for i in range(7)]
    result = _failed(place_replica(_req(gpus=1), _cap(nodes)))
    assert result.explain() == (
        "needs 1 node with 1 free h100 GPU in pool default; no node has them; "
        "n0, n1, n2, n3, n4 (+2 more): cordoned"
    )


def test_multi_node_explanation_per_fabric() -> None:
    nodes = [
        node("a", fabrics=["ib0"]),
        node("b", 4, fabrics=["ib0"]),
        node("c", fabrics=["ib1"]),
        node("d"),
        node("e", gpu_name="NVIDIA H200", fabrics=["ib1"]),
    ]
    result = _failed(place_replica(_req(gpus=8, nodes=2), _cap(nodes)))
    assert result.explain() == (
        "needs 2 nodes × 8 h100 GPUs in one fabric in pool default; "
        "fabric ib0 has 1 node with 8 free; fabric ib1 has 1 node with 8 free; "
        "b: 4 free h100 GPUs, needs 8; d: no fabric (multi-node replicas need InfiniBand, "
        "RoCE or NVLink); e: no h100 GPUs"
    )


def test_multi_node_never_mixes_gpu_models_and_says_so() -> None:
    settings = PlanSettings(gpu_class_patterns=(("hopper", "H[12]00"),))
    nodes = [node("a", fabrics=["ib0"]), node("b", gpu_name="NVIDIA H200", fabrics=["ib0"])]
    result = _failed(
        place_replica(_req(gpus=8, nodes=2, gpu_class="hopper"), _cap(nodes, settings=settings))
    )
    assert result.summary == (
        "needs 2 nodes × 8 hopper GPUs in one fabric in pool default; fabric ib0 has 1 node "
        "with 8 free of one GPU model (1 with NVIDIA H100 80GB HBM3, 1 with NVIDIA H200)"
    )


def test_multi_node_stays_in_one_fabric_and_gets_its_hcas() -> None:
    nodes = [node("a", fabrics=["ib0"]), node("b", fabrics=["ib1"]), node("c", fabrics=["ib1"])]
    p = _placed(place_replica(_req(gpus=8, nodes=2), _cap(nodes)))
    assert [a.node_id for a in p.assignments] == ["b", "c"]
    assert {a.fabric for a in p.assignments} == {"ib1"}
    assert [a.hcas for a in p.assignments] == [("mlx5_ib1",), ("mlx5_ib1",)]
    # Only rank 0 holds a leader port: the distributed-init endpoint lives on its node.
    assert [a.leader_port for a in p.assignments] == [29500, None]


def test_nvlink_domain_is_a_fabric() -> None:
    nodes = [node("a", 4, fabrics=["nvl:rack1"]), node("b", 4, fabrics=["nvl:rack1"])]
    p = _placed(place_replica(_req(gpus=4, nodes=2), _cap(nodes)))
    assert [(a.node_id, a.fabric, a.hcas) for a in p.assignments] == [
        ("a", "nvl:rack1", ()),
        ("b", "nvl:rack1", ()),
    ]


def test_trtllm_gets_the_same_gpu_indices_on_every_node() -> None:
    # a has 0-3 taken, b has 4-7 taken: no common free set of 4 ...
    nodes = [node("a", fabrics=["ib0"]), node("b", fabrics=["ib0"])]
    held = (_holding("a", ("0", "1", "2", "3")), _holding("b", ("4", "5", "6", "7")))
    result = _failed(place_replica(_req(gpus=4, nodes=2, uniform=True), _cap(nodes, held)))
    assert result.summary.startswith(
        "needs 2 nodes × 4 h100 GPUs in one fabric with the same GPU indices and the same "
        "HCAs on every node in pool default"
    )
    # ... without the rule, the same fleet takes the replica.
    assert isinstance(place_replica(_req(gpus=4, nodes=2), _cap(nodes, held)), Placement)
    # With an overlap, both ranks get identical indices.
    held = (_holding("a", ("0", "1")), _holding("b", ("6", "7")))
    p = _placed(place_replica(_req(gpus=4, nodes=2, uniform=True), _cap(nodes, held)))
    assert {tuple(g.index for g in a.gpus) for a in p.assignments} == {(2, 3, 4, 5)}


def test_trtllm_needs_the_same_hca_names() -> None:
    a = node("a", fabrics=["ib0"])
    b = node("b", fabrics=["ib0"])
    b = replace(b, fabrics=(replace(b.fabrics[0], hcas=("mlx5_9",)),))
    assert isinstance(place_replica(_req(gpus=8, nodes=2, uniform=True), _cap([a, b])), Unplaceable)
    assert isinstance(place_replica(_req(gpus=8, nodes=2), _cap([a, b])), Placement)


def test_mig_instances_for_single_gpu_profiles_never_with_their_parent() -> None:
    n = node("a", 2, mig={0: 2})
    cap = _cap([n])
    first = _placed(place_replica(_req(gpus=1), cap))
    # An instance first: whole GPUs stay free for larger profiles.
    assert first.assignments[0].gpus[0].index == 1000
    second = _placed(place_replica(_req(gpus=1), cap))
    assert second.assignments[0].gpus[0].index == 1001
    # GPU 0 is carved up and in use: the next single-GPU replica gets GPU 1, not 0.
    third = _placed(place_replica(_req(gpus=1), cap))
    assert third.assignments[0].gpus[0].index == 1
    assert isinstance(place_replica(_req(gpus=1), cap), Unplaceable)


def test_parent_in_use_blocks_its_instances() -> None:
    n = node("a", 1, mig={0: 2})
    cap = _cap([n], (_holding("a", ("0",)),))
    result = _failed(place_replica(_req(gpus=1), cap))
    assert result.node_reasons == (("a", "0 free h100 GPUs, needs 1"),)


def test_multi_gpu_profiles_never_get_mig_instances() -> None:
    n = node("a", 1, mig={0: 7})
    result = _failed(place_replica(_req(gpus=2), _cap([n])))
    assert result.node_reasons == (("a", "1 free h100 GPUs, needs 2"),)


def test_simulated_gpus_run_only_the_sim_engine() -> None:
    sim = node("s", 2, gpu_name="sim")
    result = _failed(place_replica(_req(gpus=1, gpu_class="sim"), _cap([sim])))
    assert result.node_reasons == (("s", "simulated GPUs run only the sim engine"),)
    # Even a class pattern that matches everything does not put vLLM on them.
    greedy = PlanSettings(gpu_class_patterns=(("any", ".*"),))
    assert isinstance(
        place_replica(_req(gpus=1, gpu_class="any"), _cap([sim], settings=greedy)), Unplaceable
    )
    p = _placed(place_replica(_req("sim", gpus=1, gpu_class="sim"), _cap([sim])))
    assert p.assignments[0].gpus[0].name == "sim"


def test_cpu_engines_consume_threads() -> None:
    cap = _cap([node("c", 0, threads=24)])
    p = _placed(place_replica(_req("llamacpp", gpu_class="cpu", threads=16), cap))
    assert (p.assignments[0].gpus, p.assignments[0].threads) == ((), 16)
    result = _failed(place_replica(_req("llamacpp", gpu_class="cpu", threads=16), cap))
    assert result.explain() == (
        "needs 1 node with 16 free CPU threads in pool default; no node has them; "
        "c: 8 free CPU threads, needs 16"
    )


def test_best_fit_keeps_whole_nodes_free() -> None:
    nodes = [node("a"), node("b")]
    cap = _cap(nodes, (_holding("b", ("0", "1", "2", "3")),))
    p = _placed(place_replica(_req(gpus=4, deployment="x"), cap))
    assert p.assignments[0].node_id == "b"
    # a is still whole for an 8-GPU profile.
    assert _placed(place_replica(_req(gpus=8, deployment="y"), cap)).assignments[0].node_id == "a"


def test_replicas_of_one_deployment_spread_across_nodes() -> None:
    cap = _cap([node("a"), node("b"), node("c")])
    placed = [_placed(place_replica(_req(gpus=2), cap)).assignments[0].node_id for _ in range(4)]
    assert placed[:3] == ["a", "b", "c"]
    assert len(set(placed)) == 3


def test_avoided_nodes_are_a_last_resort() -> None:
    req = _req(gpus=1)
    avoid = PlacementRequest(
        req.deployment_id,
        req.pool,
        req.gpu_class,
        req.engine,
        req.requirements,
        frozenset({NodeId("a")}),
    )
    assert _placed(place_replica(avoid, _cap([node("a"), node("b")]))).assignments[0].node_id == "b"
    assert _placed(place_replica(avoid, _cap([node("a")]))).assignments[0].node_id == "a"


def test_leader_ports_are_unique_per_node_and_reused_only_when_released() -> None:
    settings = PlanSettings(leader_port_min=40000, leader_port_max=40001)
    cap = _cap([node("a")], (_holding("a", ("0",), port=40000),), settings)
    p = _placed(place_replica(_req(gpus=1), cap))
    assert p.assignments[0].leader_port == 40001
    result = _failed(place_replica(_req(gpus=1), cap))
    assert result.node_reasons == (("a", "no free leader port in 40000-40001"),)


def test_a_gpu_held_by_a_released_shard_is_free() -> None:
    r = _holding("a", ("0",))
    released = replace(r, shards=(replace(r.shards[0], released=True),))
    p = _placed(place_replica(_req(gpus=1), _cap([node("a", 1)], (released,))))
    assert p.assignments[0].gpus == (GPU(0, "NVIDIA H100 80GB HBM3", "GPU-a-0"),)


@pytest.mark.parametrize(
    ("pattern", "name", "fits"),
    [("H100", "NVIDIA H100 80GB HBM3", True), ("H100$", "NVIDIA H100 80GB HBM3", False)],
)
def test_gpu_classes_match_by_configured_pattern(pattern: str, name: str, fits: bool) -> None:
    settings = PlanSettings(gpu_class_patterns=(("h100", pattern),))
    result = place_replica(_req(gpus=1), _cap([node("a", 1, gpu_name=name)], settings=settings))
    assert isinstance(result, Placement) is fits


def test_a_cpu_vllm_profile_is_placed_on_a_node_without_gpus() -> None:
    """Issue 35: nothing in the requirements of a vLLM profile on `gpu_class: cpu` asks for a
    GPU; it is placed by threads, as llama.cpp's are."""
    prof = EngineProfile(
        name="tiny-cpu", engine="vllm", gpu_class="cpu", threads=4, model_path="/models/tiny"
    )
    reqs = placement_requirements(prof)
    assert (reqs.cpu_only, reqs.gpus_per_node, reqs.threads, reqs.mig_allowed) == (
        True, 0, 4, False,
    )  # fmt: skip
    cap = _cap([node("g", 8), node("c", 0, threads=8)])
    req = PlacementRequest(DeploymentId("d"), "default", "cpu", "vllm", reqs)
    first = _placed(place_replica(req, cap)).assignments[0]
    assert (first.gpus, first.threads) == ((), 4)
    second = _placed(place_replica(req, cap)).assignments[0]
    assert second.threads == 4
    result = _failed(place_replica(req, cap))
    assert "needs 1 node with 4 free CPU threads" in result.explain()
