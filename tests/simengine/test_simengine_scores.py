"""`/v1/rerank` and `/v1/score` of the simulator: the pure scores.py (ranking, `top_n`, the
documents, the bounds, refusals naming the field, usage as vLLM's cross-encoder counts it),
then each route against a real `llmgw simengine` process."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from llmgw.errors import SpecError
from llmgw.simengine import scores as sc
from llmgw.simengine.tokenizer import Tokenizer
from tests.simengine.sim_process import API_KEY, SimProcess

MODEL = "sim"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Bananas are yellow fruit rich in potassium.",
    "The capital of France is Paris.",
    "Turtles are slow reptiles with shells.",
]
_TOKENIZER = Tokenizer()


def _ids(text: str) -> list[int]:
    return _TOKENIZER.tokenize(text)


def _rerank(**fields: Any) -> dict[str, Any]:
    """A rerank answer as the route builds it, from the pure module alone."""
    request = sc.RerankRequest.model_validate({"query": QUERY, "documents": DOCUMENTS, **fields})
    pairs = request.pairs()
    queries = [_ids(q) for q in pairs.queries]
    documents = [_ids(d) for d in pairs.documents]
    scores = sc.pair_scores(queries, documents, use_activation=request.use_activation)
    total = sum(sc.pair_lengths(queries, documents, 1))
    return sc.rerank_object("score-x", MODEL, pairs.documents, scores, request.top_n, total)


# ---- the pure module ------------------------------------------------------------------------


def test_the_document_sharing_words_with_the_query_ranks_first() -> None:
    body = _rerank()
    results = body["results"]
    assert results[0]["index"] == 1
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0.0 < s < 1.0 for s in scores)
    assert results[0]["relevance_score"] > 0.5 > results[-1]["relevance_score"]
    for result in results:  # each result carries its own document, as vLLM's RerankDocument
        assert result["document"] == {"text": DOCUMENTS[result["index"]], "multi_modal": None}
    assert list(body) == ["id", "model", "usage", "results"]
    # Deterministic, and a text against itself is the top of the scale.
    assert _rerank() == body
    same = sc.pair_scores([_ids(QUERY)], [_ids(QUERY)])[0]
    assert math.isclose(same, 1 / (1 + math.exp(-5)), rel_tol=1e-6)


def test_use_activation_false_returns_the_logit_under_the_sigmoid() -> None:
    queries, documents = [_ids(QUERY)], [_ids(d) for d in DOCUMENTS]
    scores = sc.pair_scores(queries, documents)
    logits = sc.pair_scores(queries, documents, use_activation=False)
    for score, logit in zip(scores, logits, strict=True):
        assert math.isclose(score, 1 / (1 + math.exp(-logit)), rel_tol=1e-5)
    # An empty text relates to nothing: a cosine of 0.
    assert sc.pair_scores([[]], [_ids("x")], use_activation=False) == [sc.LOGIT_BIAS]


def test_top_n_keeps_the_best_and_zero_or_more_keeps_all() -> None:
    every = _rerank()["results"]
    assert _rerank(top_n=2)["results"] == every[:2]
    assert _rerank(top_n=0)["results"] == every
    assert _rerank(top_n=10)["results"] == every
    with pytest.raises(ValidationError) as bad:
        sc.RerankRequest.model_validate({"query": "q", "documents": ["d"], "top_n": -1})
    assert bad.value.errors()[0]["loc"][0] == "top_n"
    # Equal scores keep the documents' order.
    tied = sc.rerank_object("score-x", MODEL, ["a", "b", "c"], [0.5, 0.7, 0.5], 0, 3)
    assert [r["index"] for r in tied["results"]] == [1, 0, 2]


def test_return_documents_is_accepted_and_documents_come_back_as_in_vllm() -> None:
    # vLLM 0.32's RerankRequest has no return_documents: an extra field, ignored.
    results = _rerank(return_documents=False)["results"]
    assert all(r["document"]["text"] == DOCUMENTS[r["index"]] for r in results)
    one = _rerank(documents="The capital of France is Paris.")["results"]
    assert [r["document"]["text"] for r in one] == ["The capital of France is Paris."]


def test_usage_counts_every_pair_the_query_again_for_each_document() -> None:
    query, docs = _ids(QUERY), [_ids(d) for d in DOCUMENTS]
    # `<s> query <s> document`: each text's tokens plus its one special token.
    lengths = sc.pair_lengths([query], docs, 1)
    assert lengths == [len(query) + len(d) + 2 for d in docs]
    usage = _rerank()["usage"]
    assert usage == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    # N:N pairs each query with its document.
    assert sc.pair_lengths([[1], [1, 2]], [[3, 4, 5], [6]], 0) == [4, 3]
    body = sc.score_object("score-x", MODEL, [0.25, 0.75], 9)
    assert body["data"] == [
        {"index": 0, "object": "score", "score": 0.25},
        {"index": 1, "object": "score", "score": 0.75},
    ]
    assert body["object"] == "list" and isinstance(body["created"], int)
    assert body["usage"] == {
        "prompt_tokens": 9,
        "total_tokens": 9,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def test_score_reads_vllms_four_spellings_in_its_order() -> None:
    def pairs(**fields: Any) -> sc.Pairs:
        return sc.ScoreRequest.model_validate(fields).pairs()

    for first, second in (
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ):
        got = pairs(**{first: "q", second: ["a", "b"]})
        assert (got.query_field, got.document_field) == (first, second)
        assert (got.queries, got.documents) == (["q"], ["a", "b"])
    both = pairs(text_1="t", text_2="u", queries="q", documents="d")
    assert (both.query_field, both.queries) == ("queries", ["q"])
    assert pairs(text_1=["a", "b"], text_2=["c", "d"]).label(1) == "text_1[1] and text_2[1]"
    assert pairs(text_1="a", text_2=["c", "d"]).label(1) == "text_1 and text_2[1]"


def _refused(make: Callable[[], object]) -> SpecError:
    with pytest.raises(SpecError) as refused:
        make()
    return refused.value


def test_bad_input_is_refused_naming_the_field() -> None:
    def rerank(**fields: Any) -> sc.Pairs:
        return sc.RerankRequest.model_validate({"query": "q", **fields}).pairs()

    def score(**fields: Any) -> sc.Pairs:
        return sc.ScoreRequest.model_validate(fields).pairs()

    image = {"content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    error = _refused(lambda: rerank(documents=["a", image]))
    assert error.field == "documents" and "documents[1]" in error.message
    assert "text only" in error.message
    error = _refused(lambda: sc.RerankRequest(query=image, documents=["a"]).pairs())
    assert error.field == "query"
    error = _refused(lambda: rerank(documents=[]))
    assert error.field == "documents" and "At least one text_pair" in error.message
    error = _refused(lambda: score(text_1=["a", "b"], text_2=["c", "d", "e"]))
    assert error.field == "text_1" and "1:1, 1:N or N:N" in error.message
    error = _refused(lambda: score(text_1=[], text_2=["c"]))
    assert error.field == "text_1" and "At least one text element" in error.message
    assert _refused(lambda: score(text_1="a")).field == "text_2"
    assert _refused(lambda: score(documents=["a"])).field == "queries"
    assert _refused(lambda: score()).field == "queries"
    # Shapes that are no ScoreInput at all are pydantic's refusal, on the field.
    for body in ({"query": ["a"], "documents": ["b"]}, {"query": "a", "documents": [1]}):
        with pytest.raises(ValidationError) as bad:
            sc.RerankRequest.model_validate(body)
        assert bad.value.errors()[0]["loc"][0] in body


def test_one_request_scores_at_most_max_pairs() -> None:
    error = _refused(
        lambda: sc.RerankRequest(query="q", documents=["d"] * (sc.MAX_PAIRS + 1)).pairs()
    )
    assert error.field == "documents" and f"at most {sc.MAX_PAIRS}" in error.message
    assert "split it into several requests" in error.message
    many = ["d"] * (sc.MAX_PAIRS + 1)
    error = _refused(lambda: sc.ScoreRequest(text_1=many, text_2=many).pairs())
    assert error.field == "text_1"
    assert len(sc.RerankRequest(query="q", documents=["d"] * sc.MAX_PAIRS).pairs().documents) == (
        sc.MAX_PAIRS
    )


def test_ids_and_the_too_long_refusal_are_vllms() -> None:
    assert re.fullmatch(r"score-[0-9a-f]{16}", sc.request_id_of(None))
    assert sc.request_id_of("abc") == "score-abc"
    error = sc.too_long_error(32768, 40000, "query and documents[2]", "documents")
    assert error.field == "documents"
    assert error.message.startswith(
        "This model's maximum context length is 32768 tokens. However, your prompt "
        "(query and documents[2]) contains 40000 input tokens"
    )


# ---- a real process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim(sim_factory: Callable[..., SimProcess]) -> SimProcess:
    return sim_factory("--served-model-name", MODEL, env={"SIMENGINE_API_KEY": API_KEY})


def _post(sim: SimProcess, path: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(f"{sim.base_url}{path}", json=body, headers=headers, timeout=30)


def _count(sim: SimProcess, text: str) -> int:
    """A text's tokens with its special tokens, as /tokenize counts them."""
    return int(httpx.post(f"{sim.base_url}/tokenize", json={"prompt": text}).json()["count"])


def _prompt_tokens(sim: SimProcess) -> float:
    text = httpx.get(f"{sim.base_url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:prompt_tokens"
        for s in f.samples
        if s.name.endswith("_total")
    )


@pytest.mark.e2e
def test_rerank_over_http(sim: SimProcess) -> None:
    before = _prompt_tokens(sim)
    response = _post(
        sim, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert re.fullmatch(r"score-[0-9a-f]{16}", body["id"]) and body["model"] == MODEL
    assert body["results"][0]["index"] == 1 and len(body["results"]) == 2
    assert body["results"][0]["document"] == {"text": DOCUMENTS[1], "multi_modal": None}
    assert body["results"] == _rerank(top_n=2)["results"]  # what the pure module computes
    expected = sum(_count(sim, QUERY) + _count(sim, d) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}
    assert _prompt_tokens(sim) - before == expected

    bad = _post(sim, "/v1/rerank", {"query": "q", "documents": ["a", {"content": []}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents", bad.text
    too_long = _post(
        sim, "/v1/rerank", {"query": "word " * 20_000, "documents": ["word " * 20_000]}
    )
    assert too_long.status_code == 400, too_long.text
    assert "maximum context length is 32768" in too_long.json()["error"]["message"]
    assert _post(sim, "/v1/rerank", {"query": "q", "documents": ["d"]}, {}).status_code == 401
    missing = _post(sim, "/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.e2e
def test_score_over_http(sim: SimProcess) -> None:
    texts = ["the quick brown fox", "a slow green turtle"]
    response = _post(
        sim,
        "/v1/score",
        {"model": MODEL, "text_1": texts, "text_2": ["the quick brown fox jumps", "a fox"]},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "score" and 0 < d["score"] < 1 for d in body["data"])
    assert body["data"][0]["score"] > 0.5 > body["data"][1]["score"]
    expected = sum(_count(sim, t) for t in texts) + _count(sim, "the quick brown fox jumps")
    expected += _count(sim, "a fox")
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == expected
    assert body["usage"]["completion_tokens"] == 0

    # The newer spelling, 1:N, with the caller's request id and the raw logit.
    newer = _post(
        sim,
        "/v1/score",
        {
            "queries": QUERY,
            "documents": DOCUMENTS,
            "request_id": "mine",
            "use_activation": False,
        },
    ).json()
    assert newer["id"] == "score-mine" and len(newer["data"]) == 3
    logits = [d["score"] for d in newer["data"]]
    assert max(range(3), key=logits.__getitem__) == 1 and min(logits) < 0

    lengths = _post(sim, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert lengths.status_code == 400 and lengths.json()["error"]["param"] == "text_1"
    assert _post(sim, "/v1/score", {"text_1": "a"}).json()["error"]["param"] == "text_2"
    assert httpx.get(f"{sim.base_url}/v1/score", headers=AUTH).status_code == 405
