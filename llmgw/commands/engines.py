"""`llmgw engines ...`: show an operator the exact processes llmgw would start for a shard.

The I/O shell around llmgw.engines: it reads the spec and GPU files and the
environment, and prints JSON. It must NOT build commands itself, and never
prints a secret unless asked to (--show-secrets).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["app", "command"]

app = typer.Typer(
    help="Show the exact commands llmgw would start for a shard.", no_args_is_help=True
)

# Exit status for a spec or profile that breaks a rule, as for a usage error.
_EXIT_INVALID = 2


def _load(path: Path) -> Any:
    import yaml

    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        return json.loads(text)
    # YAML is a superset of JSON, so one parser takes either.
    return yaml.safe_load(text)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(_EXIT_INVALID)


@app.callback()
def _group() -> None:
    """Engine launch adapters."""


@app.command("command")
def command(
    spec_file: Annotated[
        Path,
        typer.Argument(
            exists=True, dir_okay=False, help="Shard spec (profile embedded), JSON or YAML."
        ),
    ],
    gpus: Annotated[
        Path | None,
        typer.Option(
            "--gpus", exists=True, dir_okay=False, help="JSON list of GPUInfo to validate against."
        ),
    ] = None,
    show_secrets: Annotated[
        bool, typer.Option("--show-secrets", help="Print the API key and secret values.")
    ] = False,
    clean_env: Annotated[
        bool,
        typer.Option(
            "--clean-env",
            help="Leave this shell's environment out, showing only what llmgw sets.",
        ),
    ] = False,
) -> None:
    """Print the commands, environment and health endpoints of one shard as JSON."""
    import yaml

    from llmgw.engines import (
        EngineRegistry,
        EnginesConfig,
        SimConfig,
        TRTLLMConfig,
        parse_gpus,
        parse_shard_spec,
        redact_commands,
    )
    from llmgw.errors import LlmgwError

    try:
        spec = parse_shard_spec(_load(spec_file))
        gpu_list = parse_gpus(_load(gpus)) if gpus is not None else []
        # What this node would run: the simulator in this interpreter, and
        # TensorRT-LLM shown as if its trtllm-serve were on PATH.
        registry = EngineRegistry(
            EnginesConfig(
                sim=SimConfig(python_executable=sys.executable),
                trtllm=TRTLLMConfig(serve_path="trtllm-serve"),
            )
        )
        engine = registry.get(spec.profile.engine)
        for warning in engine.validate(spec.profile, gpu_list):
            typer.echo(f"warning: {warning}", err=True)
        commands = engine.commands(spec, base_env={} if clean_env else dict(os.environ))
    except LlmgwError as e:
        raise _fail(e.message) from None
    except (OSError, ValueError, yaml.YAMLError) as e:
        # json.JSONDecodeError is a ValueError.
        raise _fail(f"cannot read input: {e}") from None
    if not show_secrets:
        secrets = {"api_key": spec.api_key, **spec.secret_env}
        commands = redact_commands(commands, secrets)
    out = {
        "commands": [c.to_json_dict() for c in commands],
        "serves_http": engine.serves_http(spec),
        "health_path": engine.health_path,
        "metrics_path": engine.metrics_path,
    }
    typer.echo(json.dumps(out, indent=2))
