"""`llmgw simengine`: the simulator engine's command line (the `sim` adapter's contract).

Flags reuse vLLM's names where vLLM has the concept. The environment is read
here and only here: SIMENGINE_API_KEY (guards /v1 like VLLM_API_KEY),
VLLM_ALLOW_RUNTIME_LORA_UPDATING (attaches the runtime LoRA routes, as in vLLM) and
PYTHONHASHSEED (the block-hash seed exactly as vLLM reads it; unset means
vLLM >= 0.29's fixed default). Heavy imports stay inside the function so
`llmgw --help` stays fast.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from llmgw.http.listeners import ListenerLimits

__all__ = ["simengine"]


def _hash_seed(value: str | None) -> str | None:
    """PYTHONHASHSEED under the one seed rule llmgw applies everywhere (llmgw.engines)."""
    from llmgw.engines.spec import hash_seed_problem
    from llmgw.errors import SpecError

    if value is None:
        return None
    problem = hash_seed_problem(value)
    if problem is not None:
        raise SpecError(f"the environment's value {problem}", field="PYTHONHASHSEED")
    return value


def simengine(
    model: Annotated[
        str, typer.Option("--model", help="Reported as the model's root in /v1/models.")
    ] = "sim-model",
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="The name clients use (default: --model)."),
    ] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    lora_modules: Annotated[
        list[str] | None, typer.Option("--lora-modules", help="NAME=PATH, repeatable, in order.")
    ] = None,
    max_loras: Annotated[
        int, typer.Option("--max-loras", help="vLLM's adapters per batch (reported, not applied).")
    ] = 1,
    max_cpu_loras: Annotated[
        int | None,
        typer.Option("--max-cpu-loras", help="Adapters held at once (default: --max-loras)."),
    ] = None,
    lora_load_time_s: Annotated[
        float,
        typer.Option(
            "--lora-load-time-s",
            help="Seconds a runtime adapter load, or a re-read of an evicted one, takes.",
        ),
    ] = 0.2,
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size in tokens.")] = 16,
    num_blocks: Annotated[
        int, typer.Option("--num-blocks", help="KV cache capacity in blocks.")
    ] = 4096,
    max_num_batched_tokens: Annotated[
        int, typer.Option("--max-num-batched-tokens", help="Per-step token budget.")
    ] = 2048,
    max_num_seqs: Annotated[
        int, typer.Option("--max-num-seqs", help="Max requests holding KV.")
    ] = 256,
    max_model_len: Annotated[
        int, typer.Option("--max-model-len", help="Prompt + completion limit.")
    ] = 32768,
    kv_events_config: Annotated[
        str | None, typer.Option("--kv-events-config", help="vLLM's KVEventsConfig as JSON.")
    ] = None,
    kv_events_shape: Annotated[
        str, typer.Option("--kv-events-shape", help="map (vLLM >= 0.24) or array (<= 0.23).")
    ] = "map",
    kv_events_hash: Annotated[
        str,
        typer.Option("--kv-events-hash", help="int (uint64, vLLM's default) or bytes (digests)."),
    ] = "int",
    kv_extra_key_format: Annotated[
        str,
        typer.Option("--kv-extra-key-format", help="tagged (vLLM >= 0.31) or legacy (0.19-0.30)."),
    ] = "tagged",
    kv_transfer_config: Annotated[
        str | None,
        typer.Option(
            "--kv-transfer-config",
            help="vLLM's KVTransferConfig as JSON; the simulator runs ExampleConnector "
            "(kv_connector_extra_config.shared_storage_path: a directory producer and consumer "
            "share).",
        ),
    ] = None,
    load_time_s: Annotated[
        float, typer.Option("--load-time-s", help="Seconds before /health is 200.")
    ] = 0.0,
    time_scale: Annotated[
        float, typer.Option("--time-scale", help="Multiplies every modelled duration.")
    ] = 1.0,
    step_overhead_ms: Annotated[float, typer.Option("--step-overhead-ms")] = 2.0,
    prefill_ms_per_token: Annotated[float, typer.Option("--prefill-ms-per-token")] = 0.05,
    decode_ms_per_seq: Annotated[float, typer.Option("--decode-ms-per-seq")] = 0.3,
    kv_load_ms_per_token: Annotated[
        float,
        typer.Option(
            "--kv-load-ms-per-token",
            help="Modelled cost of a prompt token loaded from the KV connector.",
        ),
    ] = 0.005,
    seed: Annotated[int, typer.Option("--seed", help="Default sampling seed.")] = 0,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="A model directory with tokenizer.json (+ chat template) to tokenize with as "
            "vLLM does, `tiny` for the packaged tiny model's files, or `builtin` for the constructed "
            "vocabulary (the default; the engine adapter passes `tiny` to sim:// models).",
        ),
    ] = None,
    max_body_bytes: Annotated[
        int,
        typer.Option("--max-body-bytes", help="Larger request bodies get 413 (default 16 MiB)."),
    ] = 16 * 1024 * 1024,
    max_header_bytes: Annotated[
        int,
        typer.Option(
            "--max-header-bytes",
            help="Larger request lines plus headers get 431 and a close (default 64 KiB).",
        ),
    ] = 64 * 1024,
    header_timeout_s: Annotated[
        float,
        typer.Option(
            "--header-timeout-s",
            help="Seconds a request's line and headers may take to arrive, from the "
            "connection's open or their first byte; slower clients get 408 (default 10).",
        ),
    ] = 10.0,
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections",
            help="Open connections at most, lowered to what the descriptor limit allows; "
            "past it the oldest idle one is closed, or the new one (default 4096).",
        ),
    ] = 4096,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Run the simulator engine (what the `sim` engine adapter starts)."""
    from llmgw.errors import LlmgwError
    from llmgw.logs import configure_logging, get_logger

    configure_logging(log_level)
    try:
        from llmgw.simengine.config import (
            SimEngineConfig,
            parse_allow_runtime_lora_updating,
            parse_kv_events_config,
            parse_lora_module,
        )
        from llmgw.simengine.kv_storage import check_storage_dir
        from llmgw.simengine.kv_transfer import parse_kv_transfer_config
        from llmgw.simengine.scheduler import SchedulerConfig
        from llmgw.simengine.timing import TimingModel

        config = SimEngineConfig(
            model=model,
            served_model_name=served_model_name or model,
            host=host,
            port=port,
            lora_modules=tuple(parse_lora_module(m) for m in lora_modules or ()),
            scheduler=SchedulerConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
            ),
            timing=TimingModel(
                step_overhead_ms=step_overhead_ms,
                prefill_ms_per_token=prefill_ms_per_token,
                decode_ms_per_seq=decode_ms_per_seq,
                time_scale=time_scale,
                kv_load_ms_per_token=kv_load_ms_per_token,
            ),
            kv_events=parse_kv_events_config(kv_events_config),
            kv_transfer=parse_kv_transfer_config(kv_transfer_config),
            kv_events_shape=_choice("--kv-events-shape", kv_events_shape, ("map", "array")),  # type: ignore[arg-type]
            kv_events_hash=_choice("--kv-events-hash", kv_events_hash, ("int", "bytes")),  # type: ignore[arg-type]
            kv_extra_key_format=_choice(  # type: ignore[arg-type]
                "--kv-extra-key-format", kv_extra_key_format, ("tagged", "legacy")
            ),
            load_time_s=load_time_s,
            seed=seed,
            tokenizer=_tokenizer_dir(tokenizer),
            max_body_bytes=max_body_bytes,
            # vLLM hashes PYTHONHASHSEED as the string it reads; unset = its >= 0.29 default seed.
            hash_seed=_hash_seed(os.environ.get("PYTHONHASHSEED")),
            api_key=os.environ.get("SIMENGINE_API_KEY") or None,
            allow_runtime_lora_updating=parse_allow_runtime_lora_updating(
                os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
            ),
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            lora_load_time_s=lora_load_time_s,
        )
        if config.kv_transfer is not None:
            # Checked here too (the engine checks again) so a bad directory is exit 2 with the
            # path, before the server starts.
            check_storage_dir(config.kv_transfer)
        limits = _limits(max_connections, max_header_bytes, header_timeout_s)
    except LlmgwError as exc:
        get_logger(__name__).error("simengine_config_invalid", error=exc.message, field=exc.field)
        typer.echo(f"llmgw simengine: {exc.message}", err=True)
        raise typer.Exit(2) from None
    from llmgw.simengine.server import serve

    serve(config, limits=limits, log_level=log_level)


def _tokenizer_dir(value: str | None) -> str | None:
    """The directory --tokenizer names, under the sim adapter's keywords (llmgw.engines.sim)."""
    from llmgw.engines.sim import TINY_MODEL_DIR, TOKENIZER_BUILTIN, TOKENIZER_TINY

    if value == TOKENIZER_BUILTIN:
        return None
    if value == TOKENIZER_TINY:
        return TINY_MODEL_DIR
    return value


def _limits(max_connections: int, max_header_bytes: int, header_timeout_s: float) -> ListenerLimits:
    from llmgw.errors import ConfigError
    from llmgw.http.listeners import ListenerLimits

    for flag, ok, rule in (
        ("--max-connections", max_connections >= 16, "at least 16"),
        ("--max-header-bytes", max_header_bytes >= 4096, "at least 4096"),
        ("--header-timeout-s", header_timeout_s > 0, "above 0"),
    ):
        if not ok:
            raise ConfigError(f"{flag} must be {rule}; pass a larger value", field=flag)
    return ListenerLimits(
        listener="simengine",
        max_connections=max_connections,
        max_header_bytes=max_header_bytes,
        header_timeout_s=header_timeout_s,
        connections_setting="--max-connections",
        header_bytes_setting="--max-header-bytes",
    )


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    from llmgw.errors import ConfigError

    if value not in allowed:
        raise ConfigError(f"{flag} {value!r} is not one of {', '.join(allowed)}", field=flag)
    return value
