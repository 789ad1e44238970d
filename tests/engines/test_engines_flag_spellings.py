"""Reserved flags stay reserved in every spelling the engine's parser accepts (issue 8, items 8 and 13).

Each row is (engine, profile overrides, arg list, refused?). The spellings come
from the parsers themselves: vLLM 0.33's FlexibleArgumentParser (argparse with
allow_abbrev left True, dotted JSON keys, `_` folded to `-`), SGLang 0.5.23's
plain argparse, Megatron's argparse with allow_abbrev=False, click for
trtllm-serve and llmgw simengine (exact names, `name=value`), llama.cpp's
exact matcher.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.engines import Profile, refused_flags
from llmgw.errors import SpecError
from tests.engines.engines_testkit import SEED, profile, registry

KV: dict[str, Any] = {"kv_events": True, "kv_hash": {"seed": SEED}}
CPU: dict[str, Any] = {"gpu_class": "cpu"}

ROWS: list[tuple[str, dict[str, Any], list[str], bool]] = [
    # vLLM: dotted JSON keys reach --kv-events-config, replacing llmgw's whole value.
    ("vllm", KV, ["--kv-events-config.endpoint=tcp://10.0.0.9:1"], True),
    ("vllm", KV, ["--kv-events-config.topic", "x"], True),
    ("vllm", KV, ["--kv_events_config.publisher=null"], True),
    ("vllm", KV, ["--kv-events-con.topic=x"], True),  # a prefix, then a key
    ("vllm", {}, ["--port=9000"], True),
    ("vllm", {}, ["--po", "9000"], True),  # argparse prefix
    ("vllm", {}, ["--served_model_name", "x"], True),
    ("vllm", {}, ["--tensor_parallel_size=2"], True),
    ("vllm", {}, ["-tp=2"], True),
    ("vllm", {}, ["-t", "2"], True),  # a single-dash prefix of -tp
    ("vllm", {}, ["-n2"], True),  # -n 2 (--nnodes), the value glued on
    ("vllm", {}, ["-r=1"], True),
    ("vllm", {}, ["--api_key", "k"], True),
    ("vllm", {}, ["--conf", "x.yaml"], True),
    ("vllm", {}, ["--data-parallel-size-local", "2"], True),
    ("vllm", {}, ["-dpa", "10.0.0.1"], True),
    # ...and what stays open: real flags that merely start like a reserved one.
    ("vllm", {}, ["--data-parallel-size", "2"], False),
    ("vllm", {}, ["-dp", "2"], False),
    ("vllm", {}, ["--model-impl", "vllm"], False),
    ("vllm", {}, ["--config-format", "hf"], False),
    ("vllm", {}, ["--max-model-len", "8192"], False),
    ("vllm", {}, ["--compilation-config.level=3"], False),
    ("vllm", {}, ["--trust-remote-code"], False),  # open: see refused_flags
    # SGLang: argparse, abbreviations allowed.
    ("sglang", {}, ["--tp", "2"], True),
    ("sglang", {}, ["--tp-s=2"], True),
    ("sglang", {}, ["--tensor-parallel-si", "2"], True),
    ("sglang", {}, ["--conf", "x.yaml"], True),
    ("sglang", {}, ["--dist-init", "h:1"], True),
    ("sglang", {}, ["--host=0.0.0.0"], True),
    ("sglang", {}, ["--mem-fraction-static", "0.8"], False),
    # Megatron: allow_abbrev=False, so only whole names (and `=`).
    ("megatron", {}, ["--port=1"], True),
    ("megatron", {}, ["--tensor_model_parallel_size", "2"], True),
    ("megatron", {}, ["--tensor-model-parallel-si", "2"], False),  # Megatron refuses it itself
    # trtllm-serve (click): exact names or name=value.
    ("trtllm", {}, ["--tp_size=2"], True),
    ("trtllm", {}, ["--tp-size", "2"], True),  # folded: refusing more is safe
    ("trtllm", {}, ["--tp_s", "2"], False),  # click takes no prefixes
    # llama.cpp: exact.
    ("llamacpp", {}, ["--port=1"], True),
    ("llamacpp", {}, ["-m", "/x"], True),
    ("llamacpp", {}, ["--alias", "x"], True),
    ("llamacpp", CPU, ["-t", "4"], True),
    ("llamacpp", {}, ["-t", "4"], False),  # threads are the profile's only on CPU
    ("llamacpp", {}, ["--po", "1"], False),
    # sim (typer/click).
    ("sim", {}, ["--kv-events-config={}"], True),
    ("sim", {}, ["--block_size", "8"], True),
]


def _profile(engine: str, extra: dict[str, Any], args: list[str]) -> Profile:
    return profile(engine=engine, args=args, **extra)


@pytest.mark.parametrize(
    ("engine", "extra", "args", "is_refused"),
    ROWS,
    ids=[f"{e}:{' '.join(a)}" for e, _, a, _ in ROWS],
)
def test_every_spelling_the_parser_accepts_is_refused(
    engine: str, extra: dict[str, Any], args: list[str], is_refused: bool
) -> None:
    p = _profile(engine, extra, args)
    if is_refused:
        with pytest.raises(SpecError, match=r"which the .* adapter sets itself"):
            registry().get(engine).validate(p, [])
    else:
        registry().get(engine).validate(p, [])


def test_data_parallel_prefix_does_not_slip_past_the_kv_events_refusal() -> None:
    for args in (["--data-parallel-si", "2"], ["--data_parallel_size=2"], ["-dp", "2"]):
        with pytest.raises(SpecError, match="data parallelism 2 with kv_events is refused"):
            registry().get("vllm").validate(profile(args=args, **KV, gpus_per_node=2), [])


REFUSED = ["--trust-remote-code", "--worker-extension-cls", "--middleware"]


@pytest.mark.parametrize(
    ("engine", "args", "hits"),
    [
        ("vllm", ["--trust-remote-code"], ["--trust-remote-code"]),
        ("vllm", ["--trust_remote_code"], ["--trust_remote_code"]),
        ("vllm", ["--trust-rem"], ["--trust-rem"]),
        ("vllm", ["--max-model-len", "1", "--middleware=x.Y"], ["--middleware=x.Y"]),
        ("vllm", ["--worker-extension-cls", "m.C"], ["--worker-extension-cls"]),
        ("vllm", ["--enforce-eager"], []),
        ("sglang", ["--trust-remote"], ["--trust-remote"]),
        ("llamacpp", ["--trust-rem"], []),  # exact parser: no such flag, nothing set
        ("trtllm", ["--trust_remote_code"], ["--trust_remote_code"]),
    ],
)
def test_refused_flags_is_the_node_policy_hook(
    engine: str, args: list[str], hits: list[str]
) -> None:
    assert refused_flags(args, REFUSED, engine) == hits
    assert registry().get(engine).refused_flags(args, REFUSED) == hits
