"""What the agent ships for a ready shard under its profile's ``tokenizer`` field: a path names
the directory (whatever the engine reads), ``none`` ships nothing, empty asks the node's engine
adapter (``Engine.tokenizer_dir``); a path with no tokenizer.json, or outside the node's allowed
model roots, is a warning naming the path and the field, and nothing is shipped."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from llmgw.engines import Engine, EngineRegistry, EnginesConfig, ShardSpec, SimConfig
from llmgw.errors import SpecError
from llmgw.nodeagent.tokenizer_ship import TokenizerShipper, read_tokenizer_files, tokenizer_dir
from llmgw.protocol.tokenizers import TokenizerUpload
from llmgw.simengine.hf_tokens import tiny_model_dir

pytestmark = pytest.mark.timeout(30)


def _tokenizer(root: Path, name: str) -> Path:
    out = root / name
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir() / f, out / f)
    return out


def _spec(engine: str = "vllm", *, args: tuple[str, ...] = (), **profile: Any) -> dict[str, Any]:
    """A launch spec as the agent holds it (the control plane's JSON)."""
    fields: dict[str, Any] = {
        "name": "p-1",
        "engine": engine,
        "gpu_class": "cpu" if engine in ("sim", "llamacpp") else "h100",
        "model_path": "/nowhere/model",
        "args": list(args),
        **profile,
    }
    s = ShardSpec.model_validate({"replica_id": "r-1", "shard_id": "s-1", "profile": fields})
    return s.model_dump(mode="json")


def test_a_path_names_the_directory_whatever_the_engine_reads(tmp_path: Path) -> None:
    named = _tokenizer(tmp_path, "hf-tokenizer")
    engines_own = _tokenizer(tmp_path, "engines-own")
    # The engine would read another directory (its --tokenizer): the profile's wins.
    spec = _spec(args=("--tokenizer", str(engines_own)), tokenizer=str(named))
    assert tokenizer_dir(spec) == named
    # A GGUF model served by llama.cpp has no files of its own; the field gives it some.
    gguf = _spec("llamacpp", model_path="/models/q4.gguf")
    assert tokenizer_dir(gguf) is None
    assert tokenizer_dir({**gguf, "profile": {**gguf["profile"], "tokenizer": str(named)}}) == named
    # Without the field: the engine's own, as before.
    assert tokenizer_dir(_spec(args=("--tokenizer", str(engines_own)))) == engines_own
    assert tokenizer_dir(_spec(model_path=str(engines_own))) == engines_own


def test_none_ships_nothing_even_where_the_engine_has_files(tmp_path: Path) -> None:
    own = _tokenizer(tmp_path, "own")
    assert tokenizer_dir(_spec("sim")) == tiny_model_dir()
    assert tokenizer_dir(_spec("sim", tokenizer="none")) is None
    assert tokenizer_dir(_spec(model_path=str(own))) == own
    assert tokenizer_dir(_spec(model_path=str(own), tokenizer="none")) is None


def test_the_nodes_own_adapters_answer(tmp_path: Path) -> None:
    own = _tokenizer(tmp_path, "own")
    asked: list[str] = []
    registry = EngineRegistry(EnginesConfig(sim=SimConfig(python_executable="/usr/bin/python3")))

    def engines(name: str) -> Engine:
        asked.append(name)
        return registry.get(name)

    assert tokenizer_dir(_spec(model_path=str(own)), engines) == own
    assert asked == ["vllm"]

    def disabled(name: str) -> Engine:
        raise SpecError(f"engine {name!r} is disabled on this node (engines.disabled)")

    assert tokenizer_dir(_spec(model_path=str(own)), disabled) is None
    # A path or none never needs the adapter.
    assert tokenizer_dir(_spec(tokenizer=str(own)), disabled) == own
    assert tokenizer_dir(_spec(tokenizer="none"), disabled) is None


@pytest.mark.parametrize("kind", ["missing", "file", "no tokenizer.json"])
def test_a_path_without_files_is_a_warning_naming_it_and_the_field(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "tok"
    if kind == "file":
        path.write_text("{}")
    elif kind == "no tokenizer.json":
        path.mkdir()
        (path / "tokenizer_config.json").write_text("{}")
    with capture_logs() as logs:
        assert tokenizer_dir(_spec(tokenizer=str(path))) is None
    [event] = logs
    assert event["event"] == "profile_tokenizer_not_found"
    assert event["log_level"] == "warning"
    assert (event["path"], event["field"], event["profile"]) == (str(path), "tokenizer", "p-1")
    assert event["shard"] == "s-1" and "tokenizer.json" in event["problem"]


def test_a_path_outside_the_allowed_model_roots_is_not_read(tmp_path: Path) -> None:
    inside = _tokenizer(tmp_path, "models")
    outside = _tokenizer(tmp_path, "elsewhere")
    roots = (str(inside.parent / "models"),)
    assert tokenizer_dir(_spec(tokenizer=str(inside)), allowed_roots=roots) == inside
    with capture_logs() as logs:
        assert tokenizer_dir(_spec(tokenizer=str(outside)), allowed_roots=roots) is None
    [event] = logs
    assert event["event"] == "profile_tokenizer_refused"
    assert event["path"] == str(outside) and "agent.policy.allowed_model_roots" in event["problem"]


async def _ship(shipper: TokenizerShipper, shards: list[tuple[str, dict[str, Any]]]) -> None:
    shipper.ready(shards)
    if shipper._task is not None:
        await shipper._task


async def test_the_shipper_uploads_the_named_directorys_files_once(tmp_path: Path) -> None:
    named = _tokenizer(tmp_path, "hf-tokenizer")
    (named / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    sent: list[TokenizerUpload] = []

    async def upload(request: TokenizerUpload) -> None:
        sent.append(request)

    shipper = TokenizerShipper(upload)
    by_path = ("s-path", _spec(tokenizer=str(named)))
    by_none = ("s-none", _spec("sim", tokenizer="none"))
    missing = ("s-missing", _spec(tokenizer=str(tmp_path / "gone")))
    with capture_logs() as logs:
        await _ship(shipper, [by_path, by_none, missing])
        # Every shard is settled, whatever it shipped: a second pass asks nothing again.
        await _ship(shipper, [by_path, by_none, missing])
    assert [u.shard_id for u in sent] == ["s-path"]
    assert set(sent[0].files) == {"tokenizer.json", "tokenizer_config.json"}
    assert shipper._shipped["s-path"] == read_tokenizer_files(named).digest
    assert shipper._shipped["s-none"] == shipper._shipped["s-missing"] == ""
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warnings == ["profile_tokenizer_not_found"]
