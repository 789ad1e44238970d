"""The interface every engine adapter implements, and what the agent reads from it.

An adapter turns a shard spec into the processes that make up the shard and
says how to tell a loading engine from a dead one. This module must NOT start,
probe or wait for anything: readiness is a classification of a status code
the agent observed, not a probe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from llmgw.engines.command import Command
from llmgw.engines.flags import (
    FlagSyntax,
    ReservedFlag,
    check_reserved,
    flag_value,
    refused_flags,
)
from llmgw.engines.runtime_adapters import RuntimeAdapterApi
from llmgw.engines.spec import API_GENERATE, GPUInfo, Profile, ShardSpec
from llmgw.engines.validation import (
    EngineTraits,
    data_parallel_size,
    gpus_per_shard,
    validate_common,
    validate_spec_fits,
)
from llmgw.errors import SpecError

__all__ = [
    "COORDINATOR_RESUME_CALLS",
    "COORDINATOR_SUSPEND_CALLS",
    "Engine",
    "HealthState",
    "LoadMetrics",
    "Readiness",
    "host_port",
]

HealthState = Literal["ready", "loading", "unhealthy"]


@dataclass(frozen=True, slots=True)
class Readiness:
    """How an engine's health endpoint answers while it loads, once ready, and dead."""

    # Status codes that mean "still loading" before the engine was first
    # ready. vLLM has none: it binds only after loading, and its 503 means the
    # engine core died, so reading 503 as loading would wait forever on a
    # corpse.
    loading_statuses: frozenset[int]
    ready_statuses: frozenset[int] = frozenset({200})

    def classify(self, status: int | None, *, was_ready: bool) -> HealthState:
        """`status` None means the connection was refused or timed out."""
        if status in self.ready_statuses:
            return "ready"
        if was_ready:
            return "unhealthy"
        # Before the first ready answer a refused connection is an engine still
        # loading its weights; the agent's start deadline catches one that
        # never comes up.
        if status is None or status in self.loading_statuses:
            return "loading"
        return "unhealthy"


@dataclass(frozen=True, slots=True)
class LoadMetrics:
    """The Prometheus metrics an engine's /metrics reports its load under, each summed over its
    label sets: the requests it is running and those it queues. What the gateways read of an
    engine's load beside their own in-flight count (the route table carries each replica's);
    empty: the engine reports none of them, and only in-flight counts."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()

    def __or__(self, other: LoadMetrics) -> LoadMetrics:
        """Both engines' names, each once, in order."""
        return LoadMetrics(
            tuple(dict.fromkeys((*self.running, *other.running))),
            tuple(dict.fromkeys((*self.waiting, *other.waiting))),
        )


def host_port(host: str, port: int) -> str:
    """host:port, bracketing an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Megatron's coordinator, which the simulator follows, suspends only a paused engine and
# resumes to paused: pause then suspend, resume then unpause.
COORDINATOR_SUSPEND_CALLS = ("/pause", "/suspend")
COORDINATOR_RESUME_CALLS = ("/resume", "/unpause")


class Engine(ABC):
    """Builds launch commands for one inference engine."""

    traits: ClassVar[EngineTraits]
    health_path: ClassVar[str] = "/health"
    # None: the engine exports no Prometheus metrics (Megatron).
    metrics_path: ClassVar[str | None] = "/metrics"
    # Where in those metrics its running and waiting requests are (none: the gateways count
    # only their own in-flight requests on its replicas).
    load_metrics: ClassVar[LoadMetrics] = LoadMetrics()
    readiness: ClassVar[Readiness]
    # False: the engine checks no API key, so the agent must keep it on
    # loopback (or the management address behind its proxy) whatever the spec.
    authenticates: ClassVar[bool] = True
    # The engine can come up on the CPU when placed on GPUs and keep serving
    # without an error; the agent checks it is on its GPUs before calling it
    # ready (cpu_fallback_in_log, then list_devices_command).
    falls_back_to_cpu: ClassVar[bool] = False
    # The engine can free its GPU memory and resume without a restart: the agent POSTs these
    # paths (with their queries) to its HTTP port, in order. Empty: it cannot, and an idle
    # replica the control plane suspends is stopped instead (can_suspend).
    suspend_calls: ClassVar[tuple[str, ...]] = ()
    resume_calls: ClassVar[tuple[str, ...]] = ()
    # A CPU shard of this engine runs on the cores the agent picks for it (ShardSpec.cpu_cores,
    # as many as its threads); False: the agent picks none and the engine's threads go where
    # the kernel puts them.
    binds_cpu_cores: ClassVar[bool] = False
    # A multi-node replica's ranks must get the same GPU indices and HCA names
    # on every node: the leader's launcher copies its own values to every rank
    # (TensorRT-LLM's `mpirun -x`).
    uniform_ranks: ClassVar[bool] = False
    # Every flag the adapter may reserve, for any profile. With the traits'
    # flags these are the names it knows the parser has exactly, which an
    # abbreviation check must not read as prefixes of longer ones.
    all_reserved: ClassVar[tuple[ReservedFlag, ...]] = ()
    # The flags that name the directory the engine reads its tokenizer from instead of the
    # model's (tokenizer_dir); empty: the engine takes no such flag.
    tokenizer_flags: ClassVar[tuple[str, ...]] = ("--tokenizer",)
    # How the engine loads and unloads LoRA adapters while it runs (runtime_adapters.py):
    # what the agent calls to converge a shard to the adapters the leader placed on it. None:
    # it cannot, and a profile with adapter_slots > 0 is refused (check_adapter_slots).
    runtime_adapters: ClassVar[RuntimeAdapterApi | None] = None
    # The engine's name in messages to operators (llama.cpp, not llamacpp); empty: `name`.
    display_name: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def title(self) -> str:
        return self.display_name or self.name

    @property
    def loads_adapters_at_runtime(self) -> bool:
        return self.runtime_adapters is not None

    @property
    def syntax(self) -> FlagSyntax:
        """Which spellings of a flag the engine's parser accepts (flags.py)."""
        return self.traits.syntax

    def gpus_per_shard(self, profile: Profile) -> int:
        """GPUs each shard of this profile holds, data parallelism counted (0 on CPU)."""
        return gpus_per_shard(profile, self.traits)

    def data_parallel_size(self, profile: Profile) -> int:
        return data_parallel_size(profile, self.traits)

    def known_flags(self) -> frozenset[str]:
        t = self.traits
        names = {
            *t.dp_flags,
            *t.dp_within_tp_flags,
            *t.quantization_flags,
            *t.dtype_flags,
            *t.bf16_flags,
        }
        for r in self.all_reserved:
            names.update(r.names)
        return frozenset(names)

    def refused_flags(self, args: Sequence[str], refused: Collection[str]) -> list[str]:
        """The args that set a flag in `refused`, in any spelling this engine's parser takes.

        The hook for a node's local policy: see flags.refused_flags.
        """
        return refused_flags(args, refused, self.name, known=self.known_flags())

    # --- validation -------------------------------------------------------

    def validate(self, profile: Profile, gpus: Sequence[GPUInfo] = ()) -> list[str]:
        """Raise SpecError if the profile cannot work on these GPUs; return warnings.

        `gpus` are the node's (or the chosen) GPUs; empty skips the GPU checks.
        """
        if profile.engine != self.name:
            raise SpecError(
                f"profile {profile.name!r}: engine is {profile.engine!r}, not {self.name!r}",
                field="profile.engine",
            )
        warnings = validate_common(profile, gpus, self.traits)
        self._check_args(profile)
        self.check_adapter_slots(profile)
        warnings.extend(self._validate_engine(profile, gpus))
        if not self.authenticates:
            warnings.append(
                f"profile {profile.name!r}: {self.name} checks no API key; the agent keeps it "
                f"on loopback behind its authenticating proxy, never directly on a network"
            )
        return warnings

    def _check_args(self, profile: Profile) -> None:
        check_reserved(
            profile.name,
            self.name,
            profile.args,
            self.reserved_flags(profile),
            syntax=self.syntax,
            known=self.known_flags(),
        )

    def _validate_engine(self, profile: Profile, gpus: Sequence[GPUInfo]) -> list[str]:
        """Engine-specific checks beyond the common ones."""
        return []

    def check_adapter_slots(self, profile: Profile) -> None:
        """Raise SpecError when ``profile.adapter_slots`` cannot work on this engine: one that
        loads no adapters at runtime, or args that contradict the flags the slots set.

        Run where the profile is defined (validate) and again where a shard is launched
        (commands): the leader places runtime adapters only on profiles with slots, and an
        engine that never loads them would leave every one of them failed on every node."""
        if profile.adapter_slots <= 0:
            return
        if self.runtime_adapters is None:
            raise SpecError(
                f"profile {profile.name!r}: {self.title} cannot load adapters at runtime "
                f"(adapter_slots is {profile.adapter_slots}): set adapter_slots to 0 and list "
                f"the adapter in the profile's adapters",
                field="profile.adapter_slots",
            )
        self._check_adapter_args(profile)

    def _check_adapter_args(self, profile: Profile) -> None:
        """Engine-specific: the profile's args against the flags adapter_slots sets (an
        engine with runtime adapters overrides it)."""
        return None

    @abstractmethod
    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        """The flags this adapter sets itself for this profile."""

    # --- commands ---------------------------------------------------------

    def commands(self, spec: ShardSpec, *, base_env: Mapping[str, str]) -> list[Command]:
        """The processes of one shard, in start order.

        Every command but the last is a sidecar kept alive for the shard's
        lifetime; the last one's exit is the shard's exit. An empty list means
        the rank runs nothing of its own: its processes are started remotely by
        the leader's launcher (TensorRT-LLM under mpirun) and the shard only
        holds its GPUs. `base_env` is the agent's environment, inherited.
        """
        p = spec.profile
        if p.engine != self.name:
            raise SpecError(
                f"shard {spec.shard_id}: profile engine is {p.engine!r}, not {self.name!r}",
                field="profile.engine",
            )
        # The parts of validation that do not need the GPUs are repeated here:
        # this spec may come from anywhere, and its commands run as root. Unsafe
        # env is not refused here but skipped (env.py), as the seed does.
        validate_common(p.model_copy(update={"env": {}, "secret_env": {}}), (), self.traits)
        self._check_args(p)
        self.check_adapter_slots(p)
        validate_spec_fits(
            p, self.traits, rank=spec.rank, nnodes=spec.nnodes, num_gpus=spec.num_gpus
        )
        if spec.on_mig and self.gpus_per_shard(p) > 1:
            raise SpecError(
                f"shard {spec.shard_id}: a MIG instance cannot join a TP {p.tp} x PP "
                f"{p.pp_degree} or data-parallel group; MIG shards are TP = PP = 1, one GPU",
                field="gpu_uuids",
            )
        if spec.nnodes > 1 and (not spec.leader_addr or spec.leader_port <= 0):
            raise SpecError(
                f"shard {spec.shard_id}: a {spec.nnodes}-node replica needs leader_addr and "
                f"leader_port, got {spec.leader_addr!r}:{spec.leader_port}",
                field="leader_addr",
            )
        if p.kv_events and spec.leader and spec.kv_events_port <= 0:
            raise SpecError(
                f"shard {spec.shard_id}: kv_events is on but kv_events_port is "
                f"{spec.kv_events_port}; the agent must choose the port it listens on",
                field="kv_events_port",
            )
        return self._commands(spec, base_env)

    @abstractmethod
    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]: ...

    def serves_http(self, spec: ShardSpec) -> bool:
        """Whether this rank answers the OpenAI API.

        In a multi-node replica only the leader does: health-checking a
        worker's port times out and fails a replica coming up perfectly well,
        and SGLang's workers even run a dummy health server that says 200.
        """
        return spec.leader

    # --- optional capabilities --------------------------------------------

    def help_command(self, command: Command) -> tuple[str, tuple[str, ...]]:
        """How to ask the engine's program for its help text, to check flags exist.

        Engines started through an interpreter or launcher override this: their
        command's path with --help would describe the interpreter.
        """
        return command.path, ("--help",)

    def cpu_fallback_in_log(self, log: str) -> str:
        """What in the engine's log says it is serving from the CPU though placed on GPUs, or
        "" when nothing does (the default: an engine that never falls back logs no such thing).

        ``log`` is the end of the engine's output, as the agent read it."""
        return ""

    def can_suspend(self, profile: Profile) -> bool:
        """Whether a shard of ``profile`` suspends (suspend_calls) rather than stops when the
        control plane wants it asleep; an engine whose suspend is a launch option (vLLM's
        sleep mode) answers from the profile."""
        return not self.suspend_refusal(profile)

    def suspend_refusal(self, profile: Profile) -> str:
        """Why a shard of ``profile`` is stopped when the control plane wants it asleep, for
        the autoscaler's decisions and the deployment's status to say so; "" when it
        suspends. The default: an engine without suspend_calls has no suspend at all."""
        return "" if self.suspend_calls else f"{self.name} has no suspend"

    def wants_model_config(self, profile: Profile) -> bool:
        """Whether the agent should read the model's ``config.json`` (in ``model_path``, where
        that is a directory on the node) and hand it to ``check_model_config`` before starting
        a shard of ``profile``: False by default, so no other engine costs a file read."""
        return False

    def check_model_config(self, profile: Profile, config: Mapping[str, object]) -> None:
        """Raise SpecError when the model, as its parsed ``config.json`` describes it, cannot
        run under ``profile``: a limit the engine would only hit once serving (this package
        reads no files; the agent passes what it read). The default checks nothing."""
        return None

    def tokenizer_dir(self, profile: Profile) -> str | None:
        """The directory on the node whose tokenizer files (``tokenizer.json``, its config, the
        chat template) this engine reads for ``profile``, or None when it reads none that could
        be shipped: what the agent gives the gateways to tokenize the model's prompts as the
        engine does. The default: the value of the engine's tokenizer flag in the profile's
        args, else ``model_path``.

        A claim only, never checked here (this package reads no files): the agent ships a
        directory that holds ``tokenizer.json`` and nothing else, and a profile's own
        ``tokenizer`` field (a path, or ``none``) overrides this answer."""
        named = (
            flag_value(profile.args, self.tokenizer_flags, self.syntax, self.known_flags())
            if self.tokenizer_flags
            else None
        )
        return named or profile.model_path or None

    def served_apis(self, profile: Profile) -> frozenset[str]:
        """The API families (``API_GROUPS``) a process of ``profile`` serves: the profile's own
        ``apis`` where it lists any, else this engine's default for it (``default_apis``).
        What the gateways' route table reads, so a request of another family gets a 404
        naming the routes the model does serve instead of an engine's error."""
        if profile.apis:
            return frozenset(profile.apis)
        return self.default_apis(profile)

    def default_apis(self, profile: Profile) -> frozenset[str]:
        """The API families a process of ``profile`` serves when the profile says nothing:
        generation, for every engine that serves no pooling models (vLLM and the simulator
        override it). A claim from the profile alone: this package loads no model."""
        return frozenset({API_GENERATE})

    def list_devices_command(self, command: Command) -> tuple[str, tuple[str, ...]] | None:
        """A command that lists the GPUs the engine's build can see, or None."""
        return None

    def listed_devices(self, output: str) -> list[str]:
        """The devices in what ``list_devices_command`` printed: one per non-blank line unless
        the engine's listing says otherwise (an engine with such a command overrides both)."""
        return [line.strip() for line in output.splitlines() if line.strip()]

    def use_installed(self, path: str) -> bool:
        """Point the engine at a build the agent installed; False if it takes none."""
        return False
