"""How the agent reads engines' runtime LoRA answers: success, "already done", failure, and the
model list. The answers are the engines' own (vLLM 0.32, SGLang, the simulator's copy of vLLM):
llmgw/engines/runtime_adapters.py says where each comes from."""

from __future__ import annotations

import json

import pytest

from llmgw.engines.runtime_adapters import (
    SGLANG_RUNTIME_ADAPTERS,
    VLLM_RUNTIME_ADAPTERS,
    AdapterAnswer,
    EngineCall,
)

VLLM = VLLM_RUNTIME_ADAPTERS
SGLANG = SGLANG_RUNTIME_ADAPTERS


def _vllm_error(message: str, status: int, kind: str = "BadRequestError") -> str:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


def _sglang(success: bool, message: str | None = None) -> str:
    return json.dumps({"success": success, "error_message": message, "loaded_adapters": {}})


def test_calls_carry_each_engines_routes_and_field_names() -> None:
    assert VLLM.load("sql", "/a/sql") == EngineCall(
        "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}
    )
    assert VLLM.unload("sql") == EngineCall("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert SGLANG.load("sql", "/a/sql") == EngineCall(
        "/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}
    )
    assert SGLANG.unload("sql").path == "/unload_lora_adapter"
    assert VLLM.list_path == SGLANG.list_path == "/v1/models"


@pytest.mark.parametrize(
    ("status", "text", "want"),
    [
        (200, "Success: LoRA adapter 'sql' added successfully.", AdapterAnswer("ok")),
        (
            400,
            _vllm_error(
                "The lora adapter 'sql' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                400,
            ),
            AdapterAnswer(
                "already",
                "The lora adapter 'sql' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            ),
        ),
        (
            404,
            _vllm_error(
                "Loading lora sql failed: No adapter found for /a/sql", 404, "NotFoundError"
            ),
            AdapterAnswer("failed", "404: Loading lora sql failed: No adapter found for /a/sql"),
        ),
        (
            400,
            _vllm_error("The lora adapter 'm' conflicts with a served base model.", 400),
            AdapterAnswer(
                "failed", "400: The lora adapter 'm' conflicts with a served base model."
            ),
        ),
        # A 5xx is the engine failing, whatever its message quotes.
        (
            500,
            _vllm_error("worker died; has already been loaded", 500, "InternalServerError"),
            AdapterAnswer("failed", "500: worker died; has already been loaded"),
        ),
        (401, '{"error":"Unauthorized"}', AdapterAnswer("failed", "401: Unauthorized")),
        (404, '{"detail":"Not Found"}', AdapterAnswer("failed", "404: Not Found")),
        (503, "", AdapterAnswer("failed", "503")),
    ],
)
def test_vllm_load_answers(status: int, text: str, want: AdapterAnswer) -> None:
    assert VLLM.load_answer(status, text) == want


def test_vllm_unload_answers() -> None:
    assert VLLM.unload_answer(200, "Success: LoRA adapter 'sql' removed successfully.") == (
        AdapterAnswer("ok")
    )
    gone = _vllm_error("The lora adapter 'sql' cannot be found.", 404, "NotFoundError")
    assert VLLM.unload_answer(404, gone).outcome == "absent"
    assert VLLM.unload_answer(500, _vllm_error("boom", 500)) == AdapterAnswer("failed", "500: boom")


def test_sglang_answers_read_its_success_flag() -> None:
    assert SGLANG.load_answer(200, _sglang(True)) == AdapterAnswer("ok")
    exists = _sglang(False, "LoRA with name sql already exists. Loaded LoRAs: dict_keys(['sql'])")
    assert SGLANG.load_answer(400, exists).outcome == "already"
    bad = _sglang(False, "LoRA adapter sql with rank 128 is incompatible with the pool")
    assert SGLANG.load_answer(400, bad) == AdapterAnswer(
        "failed", "400: LoRA adapter sql with rank 128 is incompatible with the pool"
    )
    # A 200 that says it failed is a failure.
    assert SGLANG.load_answer(200, _sglang(False, "no")).outcome == "failed"
    missing = _sglang(False, "LoRA with name sql does not exist. Loaded LoRAs: dict_keys([])")
    assert SGLANG.unload_answer(400, missing).outcome == "absent"


def test_reasons_are_clipped() -> None:
    answer = VLLM.load_answer(500, "x" * 5000)
    assert answer.outcome == "failed" and len(answer.reason) == 512


def test_the_model_list_names_adapters_with_their_paths() -> None:
    vllm_models = {
        "object": "list",
        "data": [
            {"id": "llama", "object": "model", "root": "/models/llama", "parent": None},
            {"id": "static", "object": "model", "root": "/l/static", "parent": "llama"},
            {"id": "sql", "object": "model", "root": "/a/sql", "parent": "llama"},
        ],
    }
    assert VLLM.listed(json.dumps(vllm_models)) == {"static": "/l/static", "sql": "/a/sql"}
    # SGLang's base card has no parent at all.
    sglang_models = {"data": [{"id": "llama", "root": "llama"}, {"id": "a", "parent": "llama"}]}
    assert SGLANG.listed(json.dumps(sglang_models)) == {"a": ""}
    assert VLLM.listed("not json") is None
    assert VLLM.listed('{"error": "x"}') is None
