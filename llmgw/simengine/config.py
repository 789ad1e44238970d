"""The simulator's settings: one frozen object built by `llmgw simengine` from its flags and env.

Flag names follow vLLM wherever vLLM has the concept (the `sim` engine
adapter's contract: `--kv-events-config` takes vLLM's JSON object with vLLM's
field names), so the agent's KV-event plumbing treats the simulator exactly
like vLLM. `--kv-transfer-config` (vLLM's KVTransferConfig) is parsed in
kv_transfer.py.

Must NOT read the environment or argv itself: `llmgw/commands/simengine.py`
does, once, and passes values in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from llmgw.errors import ConfigError
from llmgw.kv.hashing import ExtraKeyFormat
from llmgw.simengine.kv_transfer import KvTransfer
from llmgw.simengine.limits import DEFAULT_MAX_BODY_BYTES
from llmgw.simengine.scheduler import SchedulerConfig
from llmgw.simengine.timing import TimingModel

__all__ = [
    "KvEventsConfig",
    "LoraModule",
    "SimEngineConfig",
    "parse_allow_runtime_lora_updating",
    "parse_kv_events_config",
    "parse_lora_module",
]


class KvEventsConfig(BaseModel):
    """vLLM's KVEventsConfig fields and defaults (reference vllm-kv-events.md §2)."""

    # Unknown keys are refused: a typo such as "replay_endpont" would silently disable replay.
    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    # Since vLLM 0.14 an unset publisher means "zmq" when events are enabled.
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    # Accepted for vLLM compatibility and unused: the simulator sends on the loop, with no queue.
    max_queue_size: int = 100000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(raw: str | None) -> KvEventsConfig:
    if raw is None or not raw.strip():
        return KvEventsConfig()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--kv-events-config is not JSON ({exc.msg} at char {exc.pos}); pass an object like "
            '\'{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:5557"}\'',
            field="kv_events_config",
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--kv-events-config is a JSON {type(data).__name__}; pass an object",
            field="kv_events_config",
        )
    try:
        config = KvEventsConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ConfigError(
            f"--kv-events-config is invalid ({problems}); use vLLM's KVEventsConfig field names",
            field="kv_events_config",
        ) from None
    if config.publisher not in (None, "zmq", "null"):
        raise ConfigError(
            f"--kv-events-config publisher {config.publisher!r} is unknown; use 'zmq' or 'null'",
            field="kv_events_config.publisher",
        )
    if config.buffer_steps < 1 or config.hwm < 0:
        raise ConfigError(
            f"--kv-events-config buffer_steps={config.buffer_steps} hwm={config.hwm}: "
            "buffer_steps must be >= 1 and hwm >= 0",
            field="kv_events_config",
        )
    return config


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str


def parse_lora_module(raw: str) -> LoraModule:
    name, sep, path = raw.partition("=")
    if not sep or not name or not path:
        raise ConfigError(
            f"--lora-modules {raw!r} is not NAME=PATH; pass e.g. --lora-modules sql=/adapters/sql",
            field="lora_modules",
        )
    return LoraModule(name=name, path=path)


def parse_allow_runtime_lora_updating(raw: str | None) -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it (`vllm/envs.py`): "1" or "true", any
    case, with surrounding spaces ignored; anything else, unset included, is off."""
    return raw is not None and raw.strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    model: str = "sim-model"
    served_model_name: str = "sim-model"
    host: str = "127.0.0.1"
    port: int = 8000
    lora_modules: tuple[LoraModule, ...] = ()
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    timing: TimingModel = field(default_factory=TimingModel)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    kv_events_shape: Literal["map", "array"] = "map"
    kv_events_hash: Literal["int", "bytes"] = "int"
    kv_extra_key_format: ExtraKeyFormat = "tagged"
    # --kv-transfer-config: vLLM's shared-storage KV connector (kv_transfer.py); None = none.
    kv_transfer: KvTransfer | None = None
    load_time_s: float = 0.0
    seed: int = 0
    # --tokenizer: a model directory's tokenizer files (tokenizer.json + chat template), used as
    # vLLM uses them; None: the constructed vocabulary (tokenizer.py). `llmgw simengine`
    # defaults to the packaged tiny model's.
    tokenizer: str | None = None
    # PYTHONHASHSEED as the engine saw it; None = vLLM >= 0.29's fixed default seed.
    hash_seed: str | None = None
    # SIMENGINE_API_KEY; None = /v1 is open.
    api_key: str | None = None
    # --max-body-bytes: larger request bodies are refused 413 (limits.py says why and how).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: attaches /v1/load_lora_adapter and
    # /v1/unload_lora_adapter (lora_routes.py); False leaves them absent (404), as in vLLM.
    allow_runtime_lora_updating: bool = False
    # --max-loras: vLLM's adapters per batch. It is the `max_lora` label of
    # vllm:lora_requests_info and the floor of max_cpu_loras. The simulator's scheduler does
    # not apply it to batches (lora_runtime.py says what follows from that).
    max_loras: int = 1
    # --max-cpu-loras: adapters held at once, least recently used evicted past it
    # (lora_runtime.py). None: max_loras, vLLM's default.
    max_cpu_loras: int | None = None
    # --lora-load-time-s: seconds a runtime load takes before it answers, and the extra time of a
    # step that reads an evicted adapter again. Wall seconds like --load-time-s, not multiplied
    # by --time-scale: a load is disk I/O, not GPU work the scale stands for.
    lora_load_time_s: float = 0.2

    def __post_init__(self) -> None:
        names = [self.served_model_name, *(m.name for m in self.lora_modules)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(
                f"model names {duplicates} are used twice (served name and LoRA modules share "
                "one namespace); give every adapter its own name",
                field="lora_modules",
            )
        if self.load_time_s < 0:
            raise ConfigError(f"--load-time-s {self.load_time_s} is negative", field="load_time_s")
        if not self.lora_load_time_s >= 0:  # also catches NaN
            raise ConfigError(
                f"--lora-load-time-s {self.lora_load_time_s} is negative; use a value >= 0",
                field="lora_load_time_s",
            )
        if self.max_loras < 1:
            raise ConfigError(
                f"--max-loras {self.max_loras} is below 1; a batch holds at least one adapter",
                field="max_loras",
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM's LoRAConfig check, with its wording first.
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}); "
                "raise --max-cpu-loras or leave it unset (it defaults to --max-loras)",
                field="max_cpu_loras",
            )
        if self.max_body_bytes < 1024:
            # Below 1 KiB even a one-line chat request (model, messages, headers' worth of
            # options) would be refused.
            raise ConfigError(
                f"--max-body-bytes {self.max_body_bytes} is below 1024; a request body needs "
                "at least that much room",
                field="max_body_bytes",
            )

    @property
    def lora_capacity(self) -> int:
        """Adapters held at once: --max-cpu-loras, else --max-loras (vLLM's default)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def lora_enabled(self) -> bool:
        """Whether this engine serves adapters at all: vLLM would be started with --enable-lora
        for --lora-modules or runtime loading. It decides whether vllm:lora_requests_info exists."""
        return bool(self.lora_modules) or self.allow_runtime_lora_updating
