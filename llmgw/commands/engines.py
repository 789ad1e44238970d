"""`llmgw engines ...`: show an operator the exact processes llmgw would start for a shard.

The I/O shell around llmgw.engines: it reads the spec and GPU files and the
environment, and prints JSON. It must NOT build commands itself, and never
prints a secret unless asked to (--show-secrets): the environment shown is the
allow-listed one an agent would pass (llmgw.engines.base_env_from), and every
secret-looking variable or flag value is redacted as well as the spec's own
secrets. Errors name the file, field, line and column, never the content: the
file given may be anything readable (`/etc/shadow`, a spec with a key inside).
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
# A shard spec is a few KiB; reading more only lets a wrong path (a device, a
# log) take memory.
_MAX_INPUT_BYTES = 1 << 20


class _InputError(Exception):
    """A file that cannot be read as a document; the message holds no content."""


def _load(path: Path) -> Any:
    import yaml

    from llmgw.errors import SpecError

    with path.open("rb") as f:
        data = f.read(_MAX_INPUT_BYTES + 1)
    if len(data) > _MAX_INPUT_BYTES:
        raise _InputError(f"{path}: larger than {_MAX_INPUT_BYTES} bytes; is it a shard spec?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _InputError(f"{path}: not UTF-8 text (byte offset {exc.start})") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        # YAML is a superset of JSON, so one parser takes either; llmgw's strict one (no
        # aliases, no duplicate keys, bounded), as `llmgw apply` reads files.
        from llmgw.documents import load_yaml

        return load_yaml(text, str(path))
    except SpecError as exc:
        raise _InputError(exc.message) from None
    except json.JSONDecodeError as exc:
        raise _InputError(
            f"{path}: not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except yaml.MarkedYAMLError as exc:
        # str(exc) quotes the offending line; only the position is reported.
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise _InputError(f"{path}: not YAML: {exc.problem or 'syntax error'}{where}") from None
    except yaml.YAMLError:
        raise _InputError(f"{path}: not YAML") from None
    except RecursionError:
        raise _InputError(f"{path}: nests too deeply to be a shard spec") from None


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
        bool,
        typer.Option(
            "--show-secrets",
            help="Print the API key, secret values and secret-looking variables unredacted.",
        ),
    ] = False,
    clean_env: Annotated[
        bool,
        typer.Option(
            "--clean-env",
            help="Leave this shell's environment out, showing only what llmgw sets "
            "(otherwise the allow-listed part an agent would pass on is shown).",
        ),
    ] = False,
) -> None:
    """Print the commands, environment and health endpoints of one shard as JSON."""
    from llmgw.engines import (
        EngineRegistry,
        EnginesConfig,
        SimConfig,
        TRTLLMConfig,
        base_env_from,
        parse_gpus,
        parse_shard_spec,
        redact_commands,
        redact_secret_names,
    )
    from llmgw.errors import LlmgwError

    try:
        doc = _load(spec_file)
        if not isinstance(doc, dict):
            # A string or list here is some other file: say so without its content.
            raise _InputError(
                f"{spec_file}: a shard spec is a mapping of fields, this file holds a "
                f"{type(doc).__name__}"
            )
        spec = parse_shard_spec(doc)
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
        commands = engine.commands(spec, base_env={} if clean_env else base_env_from(os.environ))
    except LlmgwError as e:
        raise _fail(f"{spec_file}: {e.message}") from None
    except _InputError as e:
        raise _fail(f"cannot read input: {e}") from None
    except OSError as e:
        raise _fail(f"cannot read input: {e.filename or ''}: {e.strerror}") from None
    except RecursionError:
        raise _fail("cannot read input: the spec nests too deeply") from None
    if not show_secrets:
        secrets = {"api_key": spec.api_key, **spec.secret_env}
        commands = redact_secret_names(redact_commands(commands, secrets))
    out = {
        "commands": [c.to_json_dict() for c in commands],
        "serves_http": engine.serves_http(spec),
        "health_path": engine.health_path,
        "metrics_path": engine.metrics_path,
    }
    typer.echo(json.dumps(out, indent=2))
