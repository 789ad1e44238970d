"""llmgw.engines stays pure, documented and honest about the flags it emits."""

from __future__ import annotations

import ast
from pathlib import Path

from llmgw.engines import Adapter, KVHashParams
from tests.engines.engines_testkit import build, profile, spec

PACKAGE = Path(__file__).resolve().parents[2] / "llmgw" / "engines"
FORBIDDEN = {
    "sqlalchemy", "httpx", "aiohttp", "zmq", "asyncio", "fastapi", "subprocess", "socket",
    "requests", "urllib", "shutil", "tempfile", "threading", "multiprocessing", "structlog",
}  # fmt: skip
ALLOWED_TOP = {
    "__future__",
    "abc",
    "collections",
    "dataclasses",
    "hashlib",
    "json",
    "posixpath",
    "re",
    "typing",
    "pydantic",
    "llmgw",
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.glob("*.py"))


def test_imports_only_pure_modules() -> None:
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{path.name} imports {name}"
                assert top in ALLOWED_TOP, f"{path.name} imports {name}"
                if top == "llmgw":
                    assert name.startswith(("llmgw.engines", "llmgw.errors")), (
                        f"{path.name} imports {name}"
                    )


def test_reads_no_process_state() -> None:
    # os and sys are not importable here at all (above); builtins that do I/O
    # or run code are refused by name.
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                assert node.id not in {"open", "exec", "eval", "__import__", "input", "print"}, (
                    f"{path.name} uses {node.id}"
                )


def test_every_module_has_a_docstring_and_all() -> None:
    for path in _modules():
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), path.name
        assert any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
            for n in tree.body
        ), path.name


# Flags each engine's real CLI has, as each engine's own argument parser or docs define
# them (section noted). `ray start` flags beyond the reference's example are marked in vllm.py.
REFERENCE_FLAGS = {
    # §1 vLLM
    "vllm": {
        "--served-model-name", "--host", "--port", "--tensor-parallel-size", "--pipeline-parallel-size",
        "--enable-lora", "--lora-modules", "--enable-prefix-caching", "--prefix-caching-hash-algo",
        "--block-size", "--kv-events-config", "--nnodes", "--node-rank", "--master-addr",
        "--master-port", "--headless", "--distributed-executor-backend",
    },
    "ray": {"--head", "--port", "--address", "--node-ip-address", "--disable-usage-stats", "--block"},
    # §2 SGLang (started as python -m sglang.launch_server)
    "sglang": {
        "-m", "--model-path", "--served-model-name", "--host", "--port", "--tp-size", "--pp-size", "--device",
        "--enable-metrics", "--nnodes", "--node-rank", "--dist-init-addr", "--enable-lora", "--lora-paths",
        "--config",
    },
    # §3 llama-server
    "llamacpp": {"--model", "--alias", "--host", "--port", "--metrics", "-ngl", "--threads", "--lora"},
    # §4 trtllm-serve, and mpirun (-np, --host, -x)
    "trtllm": {"--host", "--port", "--tp_size", "--pp_size", "--gpus_per_node", "--extra_llm_api_options", "-np", "-x"},
    # §5.1 torchrun + launch_inference_server
    "megatron": {
        "--nproc-per-node", "--standalone", "--nnodes", "--node-rank", "--master-addr", "--master-port",
        "-m", "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--load",
        "--use-checkpoint-args", "--host", "--port",
    },
    # SIMCLI
    "sim": {
        "-m", "--model", "--served-model-name", "--host", "--port", "--block-size",
        "--kv-extra-key-format", "--lora-modules", "--kv-events-config", "--tokenizer",
    },
}  # fmt: skip


def test_every_emitted_flag_is_in_the_reference() -> None:
    kv = {"kv_events": True, "kv_hash": KVHashParams(seed="7")}
    ads = [Adapter(name="a", path="/l/a")]
    cases = [
        spec(profile(adapters=ads, **kv), kv_events_port=1, kv_replay_port=2),
        spec(profile(tp=4, nodes=2, gpus_per_node=2, multinode_backend="native"), rank=1, nnodes=2, leader_addr="h", leader_port=1, node_addr="w"),
        spec(profile(tp=4, nodes=2, gpus_per_node=2), rank=0, nnodes=2, leader_addr="h", leader_port=1),
        spec(profile(tp=4, nodes=2, gpus_per_node=2), rank=1, nnodes=2, leader_addr="h", leader_port=1, node_addr="w"),
        spec(profile(engine="sglang", tp=2, nodes=2, gpus_per_node=1, adapters=ads), rank=1, nnodes=2, leader_addr="h", leader_port=1, api_key="k"),
        spec(profile(engine="llamacpp", adapters=ads, threads=4)),
        spec(profile(engine="llamacpp", gpu_class="cpu"), threads=2),
        spec(profile(engine="trtllm", tp=2, nodes=2, gpus_per_node=1, adapters=ads), nnodes=2, leader_addr="h", leader_port=1, peer_addrs=["h", "w"]),
        spec(profile(engine="megatron", tp=2, nodes=2, gpus_per_node=1), nnodes=2, leader_addr="h", leader_port=1),
        spec(profile(engine="megatron")),
        spec(profile(engine="sim", adapters=ads, **kv), kv_events_port=1),
    ]  # fmt: skip
    for s in cases:
        for c in build(s):
            known = REFERENCE_FLAGS["ray" if c.path == "ray" else s.profile.engine]
            for arg in c.args:
                if arg.startswith("-"):
                    flag = arg.split("=", 1)[0]
                    assert flag in known, (
                        f"{s.profile.engine} ({c.name}) emits {flag}, not in the reference"
                    )
