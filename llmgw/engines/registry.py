"""The engines a node knows, built from its configuration.

This module must NOT probe the node for installed engines: which are disabled
or offered is configuration, decided by the operator and passed in.
"""

from __future__ import annotations

from llmgw.engines.config import EnginesConfig, TRTLLMConfig
from llmgw.engines.engine import Engine, LoadMetrics
from llmgw.engines.llamacpp import LlamaCpp
from llmgw.engines.megatron import Megatron
from llmgw.engines.sglang import SGLang
from llmgw.engines.sim import Sim
from llmgw.engines.spec import canonical_engine
from llmgw.engines.trtllm import TRTLLM
from llmgw.engines.vllm import VLLM
from llmgw.errors import SpecError

__all__ = [
    "ANY_ENGINE_LOAD_METRICS",
    "ENGINE_NAMES",
    "EngineRegistry",
    "engine_load_metrics",
    "reference_engine",
]

ENGINE_NAMES = ("llamacpp", "megatron", "sglang", "sim", "trtllm", "vllm")


class EngineRegistry:
    """The built-in engines, minus those this node disables or cannot offer."""

    def __init__(self, config: EnginesConfig | None = None) -> None:
        cfg = config or EnginesConfig()
        unknown = sorted(set(cfg.disabled) - set(ENGINE_NAMES))
        if unknown:
            raise SpecError(
                f"engines.disabled names unknown engines {', '.join(unknown)} "
                f"(have {', '.join(ENGINE_NAMES)})",
                field="engines.disabled",
            )
        self._disabled = frozenset(cfg.disabled)
        self._engines: dict[str, Engine] = {}
        for engine in (
            VLLM(cfg.vllm),
            SGLang(cfg.sglang),
            LlamaCpp(cfg.llamacpp),
            TRTLLM(cfg.trtllm),
            Megatron(cfg.megatron),
            Sim(cfg.sim),
        ):
            self.add(engine)

    def add(self, engine: Engine) -> None:
        """Register an engine, replacing one of the same name."""
        self._engines[engine.name] = engine

    def _unavailable(self, name: str) -> str | None:
        if name in self._disabled:
            return f"engine {name!r} is disabled on this node (engines.disabled)"
        engine = self._engines.get(name)
        if isinstance(engine, TRTLLM) and not engine.offered:
            return (
                f"engine {name!r} is not offered on this node: set engines.trtllm.serve_path "
                f"to TensorRT-LLM's trtllm-serve"
            )
        return None

    def get(self, name: str) -> Engine:
        """The engine by name, or a SpecError naming the engines there are."""
        if name not in self._engines:
            raise SpecError(
                f"unknown engine {name!r} (have {', '.join(sorted(self._engines))})",
                field="profile.engine",
            )
        why = self._unavailable(name)
        if why is not None:
            raise SpecError(why, field="profile.engine")
        return self._engines[name]

    def names(self) -> list[str]:
        """The engines this node offers, sorted."""
        return sorted(n for n in self._engines if self._unavailable(n) is None)

    def use_installed(self, name: str, path: str) -> bool:
        """Point an engine at a build the agent installed; False if it takes none."""
        engine = self._engines.get(name)
        return engine.use_installed(path) if engine is not None else False


# Every engine offered, programs by their plain names: what the control plane's
# pure computations (fingerprints, placement requirements) read adapters as.
# Never given installed paths, so nothing node-specific leaks into them.
_REFERENCE = EngineRegistry(EnginesConfig(trtllm=TRTLLMConfig(serve_path="trtllm-serve")))


def reference_engine(name: str) -> Engine:
    """The adapter of engine `name` as every node would build it, or a SpecError."""
    return _REFERENCE.get(name)


# An engine this release does not know (a launch spec of another release): every name any
# adapter reports its load under, as it is likely one of them (names never collide).
def _any_engine_load_metrics() -> LoadMetrics:
    out = LoadMetrics()
    for engine in _REFERENCE._engines.values():
        out |= engine.load_metrics
    return out


ANY_ENGINE_LOAD_METRICS = _any_engine_load_metrics()


def engine_load_metrics(name: str) -> LoadMetrics:
    """Where engine ``name``'s /metrics reports its load (``Engine.load_metrics``); an unknown
    name gets ``ANY_ENGINE_LOAD_METRICS``."""
    engine = _REFERENCE._engines.get(canonical_engine(name))
    return engine.load_metrics if engine is not None else ANY_ENGINE_LOAD_METRICS
