"""What placement must give a profile's shards, as the engine will use them.

One pure answer for the placement code (issue 8 items 11 and 12): how many
nodes, how many GPUs on each (tensor x pipeline parallel, and data
parallelism, which vLLM and SGLang run as more processes on more GPUs), and
the constraints a launcher imposes on the whole replica. Placing by the
profile's tp x pp alone would start a `--data-parallel-size 4` shard on one
GPU, where it crash-loops.

This module must NOT choose nodes or GPUs: it states requirements, placement
meets them and `check_replica_specs` refuses a replica that does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.engines.registry import reference_engine
from llmgw.engines.spec import Profile, ShardSpec
from llmgw.errors import SpecError

__all__ = ["PlacementRequirements", "check_replica_specs", "placement_requirements"]


@dataclass(frozen=True, slots=True)
class PlacementRequirements:
    """The resources one replica of a profile needs, per node."""

    gpu_class: str
    nodes: int
    # GPUs each node's shard holds: TP x PP x DP as the engine runs them, or
    # the profile's gpus_per_node; 0 for a CPU profile.
    gpus_per_node: int
    # CPU cores a CPU shard computes on; 0 leaves the number to placement.
    threads: int
    cpu_only: bool
    # A MIG slice is one CUDA device without P2P: only a one-GPU shard fits.
    mig_allowed: bool
    # The leader's launcher copies its CUDA_VISIBLE_DEVICES and NCCL_IB_HCA to
    # every rank (TensorRT-LLM's `mpirun -x`): every node must get the same
    # GPU indices and the same HCA names, or ranks use cards another shard
    # holds and adapters that do not exist there.
    same_gpu_indices_across_nodes: bool
    same_hcas_across_nodes: bool


def placement_requirements(profile: Profile) -> PlacementRequirements:
    """What placement must give `profile`'s replicas; SpecError for an unknown engine."""
    engine = reference_engine(profile.engine)
    gpus = engine.gpus_per_shard(profile)
    uniform = engine.uniform_ranks and profile.num_nodes > 1
    return PlacementRequirements(
        gpu_class=profile.gpu_class,
        nodes=profile.num_nodes,
        gpus_per_node=gpus,
        threads=profile.threads if profile.cpu_only else 0,
        cpu_only=profile.cpu_only,
        mig_allowed=not profile.cpu_only and gpus == 1 and profile.num_nodes == 1,
        same_gpu_indices_across_nodes=uniform,
        same_hcas_across_nodes=uniform,
    )


def check_replica_specs(specs: Sequence[ShardSpec]) -> None:
    """Refuse a replica's shard specs that cannot run together, naming the rank and field.

    One spec per rank, of one replica and one profile; where the engine's
    launcher copies the leader's devices to every rank, every rank has the
    leader's GPU indices, HCAs, GID index and management interface.
    """
    if not specs:
        raise SpecError("a replica needs at least one shard spec", field="specs")
    leader = min(specs, key=lambda s: s.rank)
    nnodes = leader.nnodes
    ranks = sorted(s.rank for s in specs)
    if ranks != list(range(nnodes)):
        raise SpecError(
            f"replica {leader.replica_id}: ranks {ranks} are not 0..{nnodes - 1}, one each",
            field="rank",
        )
    for s in specs:
        if s.replica_id != leader.replica_id or s.nnodes != nnodes or s.profile != leader.profile:
            raise SpecError(
                f"replica {leader.replica_id}: shard {s.shard_id} (rank {s.rank}) belongs to "
                f"replica {s.replica_id} with {s.nnodes} nodes or another profile; one replica's "
                f"shards share replica_id, nnodes and profile",
                field="replica_id",
            )
    req = placement_requirements(leader.profile)
    if not req.same_gpu_indices_across_nodes and not req.same_hcas_across_nodes:
        return
    for s in specs:
        for field in ("gpu_indices", "gpu_uuids", "hcas", "gid_index", "mgmt_interface"):
            mine, theirs = getattr(s, field), getattr(leader, field)
            if mine != theirs:
                raise SpecError(
                    f"replica {leader.replica_id}: rank {s.rank} has {field} {mine!r} but the "
                    f"leader has {theirs!r}; {leader.profile.engine}'s launcher copies the "
                    f"leader's values to every rank, so placement must give every node the "
                    f"same {field}",
                    field=field,
                )
