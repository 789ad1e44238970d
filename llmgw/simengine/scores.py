"""`/v1/rerank` and `/v1/score` in the simulator: relevance of text pairs from pseudo-embeddings.

The simulator plays a cross-encoder reranker, the kind of model vLLM usually serves these
routes with (a `classify` pooling model: each (query, document) pair is one prompt, its
classifier's logit passed through a sigmoid). It has no classifier, so a pair's logit is made
from the cosine of the two texts' pseudo-embeddings (embeddings.py's feature hashing, of their
tokens without special tokens, which every text would share), taken over the coordinates past
the first 24: those hold the nested Matryoshka probes where every token of every text lands,
which would make unrelated texts' cosines spread ~0.23 instead of ~0.07. Then
`logit = 10 * cosine - 5` and the score is `sigmoid(logit)`, in (0, 1).

Why this and not vLLM's bi-encoder answer (the raw cosine, in [-1, 1]): rerank clients and
RAG code threshold scores in [0, 1] as a cross-encoder gives them, and the sigmoid places them
as a real reranker does: unrelated texts (cosine near 0) near 0.007, a text against itself
near 0.993, texts sharing half their tokens near 0.5. The order is the cosine's, so a document
sharing words with the query scores higher, and the same texts always score the same, in
every process. `use_activation: false` returns the logit, as vLLM's cross-encoder does.

Shapes follow vLLM 0.32 (vllm/entrypoints/pooling/scoring/protocol.py, serving.py, utils.py):

- rerank: `query`, `documents` (a string or strings), `top_n` (0, the default: all). The
  results are sorted by `relevance_score`, highest first (ties keep the documents' order),
  each with the document's `index` and the document (`{"text", "multi_modal": null}`):
  vLLM 0.32 has no `return_documents` and always returns them; like every field it does not
  know (OpenAIBaseModel allows extras), it is accepted and ignored.
- score: the pairs in any of vLLM's four spellings, the first one complete in the order of
  vLLM's `ScoreRequest` union: `queries`/`documents`, `queries`/`items`, `data_1`/`data_2`,
  `text_1`/`text_2`; each side a string or strings, paired 1:1, 1:N or N:N.
- ids are vLLM's `score-<request_id>` on both routes (the body's `request_id`, else 16 random
  hex digits); usage is `prompt_tokens` = `total_tokens` (score's as a whole UsageInfo).
- usage counts what the cross-encoder runs: one prompt per pair, the query again for every
  document (serving.py sums the length of every engine prompt). A pair's prompt is the two
  texts' own encodings back to back, as a Llama tokenizer's pair template gives it
  (`<s> query <s> document`), so a pair costs its two texts' tokens plus twice the special
  tokens one text gets; a pair over the context is refused with vLLM's message
  (renderers/params.py `_token_len_check`).

Where it differs: at most `MAX_PAIRS` documents (and queries) per request (vLLM sets none;
the simulator must not be what one request can freeze), the same bound and refusal as
embeddings' `MAX_INPUTS`; multi-modal inputs (`{"content": [...]}`) are refused naming the
field, as vLLM refuses them for a text-only model; the truncation and template fields
(`truncate_prompt_tokens`, `max_tokens_per_query`, `max_tokens_per_doc`, `instruction`,
`chat_template_kwargs`) are accepted and ignored; vLLM's unauthenticated aliases (`/rerank`,
`/score`) and `/v2/rerank` are not served.

Like embeddings, scoring bypasses the generation scheduler (no blocks, no KV events); the shell
models its cost as one prefill step over every pair's tokens.

Must NOT touch the engine or sockets (api_routes.py does).
"""

from __future__ import annotations

import math
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from llmgw.errors import SpecError
from llmgw.simengine.embeddings import embedding

__all__ = [
    "LOGIT_BIAS",
    "LOGIT_SCALE",
    "MAX_PAIRS",
    "Pairs",
    "RerankRequest",
    "ScoreRequest",
    "pair_lengths",
    "pair_scores",
    "request_id_of",
    "rerank_object",
    "score_object",
    "too_long_error",
]

MAX_PAIRS: Final = 2048
LOGIT_SCALE: Final = 10.0
LOGIT_BIAS: Final = -5.0
# Coordinates below this hold embeddings.py's nested Matryoshka probes, where every token of
# every text lands (all of them on coordinate 0): a cosine over them has a spread of ~0.23
# between unrelated texts; past them it has ~0.07 (the probes there rarely collide).
_SCORED_FROM: Final = 24
_MASK64: Final = (1 << 64) - 1
# vLLM's ScoreRequest union, in its order: the first spelling whose two fields are both sent.
_SPELLINGS: Final = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)

# vLLM's ScoreInput: a text, or a multi-modal `{"content": [...]}` the simulator refuses.
_Input = str | dict[str, Any]
_Inputs = _Input | list[_Input]


@dataclass(frozen=True, slots=True)
class Pairs:
    """What a request scores: queries (one, or one per document) and documents, as texts,
    with the fields they came in (for errors)."""

    query_field: str
    document_field: str
    queries: list[str]
    documents: list[str]
    queries_listed: bool
    documents_listed: bool

    def label(self, index: int) -> str:
        """The fields a pair came from: `query and documents[3]`, `text_1[3] and text_2[3]`."""
        query_index = 0 if len(self.queries) == 1 else index
        first = f"{self.query_field}[{query_index}]" if self.queries_listed else self.query_field
        second = f"{self.document_field}[{index}]" if self.documents_listed else self.document_field
        return f"{first} and {second}"


def _texts(value: _Inputs, field: str) -> tuple[list[str], bool]:
    listed = isinstance(value, list)
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_PAIRS:
        raise SpecError(
            f"{field} has {len(items)} items; at most {MAX_PAIRS} are scored per request: "
            "split it into several requests",
            field=field,
        )
    texts: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, str):
            where = f"{field}[{index}]" if listed else field
            raise SpecError(
                f"{where} is a multi-modal input ({{'content': [...]}}); MultiModalParam is "
                "not supported by the simulator, which scores text only: send a string",
                field=field,
            )
        texts.append(item)
    return texts, listed


def _pairs(query_field: str, query: _Inputs, document_field: str, documents: _Inputs) -> Pairs:
    """vLLM's validate_score_input, with its messages (and the field at fault)."""
    queries, queries_listed = _texts(query, query_field)
    docs, documents_listed = _texts(documents, document_field)
    if not queries:
        raise SpecError(
            f"At least one text element must be given ({query_field} is empty)",
            field=query_field,
        )
    if not docs:
        raise SpecError(
            f"At least one text_pair element must be given ({document_field} is empty)",
            field=document_field,
        )
    if len(queries) > 1 and len(queries) != len(docs):
        raise SpecError(
            f"Input lengths must be either 1:1, 1:N or N:N ({query_field} has {len(queries)} "
            f"items, {document_field} {len(docs)})",
            field=query_field,
        )
    return Pairs(query_field, document_field, queries, docs, queries_listed, documents_listed)


class _ScoringFields(BaseModel):
    """vLLM's ScoringRequestMixin, as far as the simulator reads it (extras are allowed)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    use_activation: bool | None = None
    request_id: str | None = None


class RerankRequest(_ScoringFields):
    query: _Input
    documents: _Inputs
    top_n: int = Field(default=0, ge=0)

    def pairs(self) -> Pairs:
        return _pairs("query", self.query, "documents", self.documents)


class ScoreRequest(_ScoringFields):
    queries: _Inputs | None = None
    documents: _Inputs | None = None
    items: _Inputs | None = None
    data_1: _Inputs | None = None
    data_2: _Inputs | None = None
    text_1: _Inputs | None = None
    text_2: _Inputs | None = None

    def pairs(self) -> Pairs:
        sent = {
            name: value
            for name in ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
            if (value := getattr(self, name)) is not None
        }
        for first, second in _SPELLINGS:
            if first in sent and second in sent:
                return _pairs(first, sent[first], second, sent[second])
        for first, second in _SPELLINGS:
            if first in sent or second in sent:
                missing = second if first in sent else first
                raise SpecError(
                    f"{missing} is required with {first if first in sent else second}: send "
                    f"both {first} and {second}",
                    field=missing,
                )
        raise SpecError(
            "send the texts to score as queries and documents (vLLM also reads text_1 and "
            "text_2, data_1 and data_2, queries and items)",
            field="queries",
        )


def too_long_error(
    max_model_len: int, num_tokens: int, where: str, field: str, *, at_least: bool = False
) -> SpecError:
    """vLLM's refusal of a pair over the context (renderers/params.py _token_len_check);
    `at_least` when one text alone is over it (its pair was not counted whole)."""
    qualifier = "at least " if at_least else ""
    return SpecError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"({where}) contains {qualifier}{num_tokens} input tokens, which exceeds this limit "
        "even without any output tokens. Please reduce the length of the input prompt.",
        field=field,
    )


def pair_lengths(
    query_ids: Sequence[Sequence[int]], document_ids: Sequence[Sequence[int]], special: int
) -> list[int]:
    """Each pair's prompt length: both texts' tokens (special tokens left out) plus each one's
    `special` tokens, the query repeated for every document when there is one query."""
    queries = [len(q) for q in query_ids]
    if len(queries) == 1:
        queries = queries * len(document_ids)
    return [q + len(d) + 2 * special for q, d in zip(queries, document_ids, strict=True)]


def _float32(value: float) -> float:
    return array("f", (value,))[0]


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two pseudo-embeddings over their coordinates past the first
    `_SCORED_FROM`; over all of them when either has nothing there (a one-token text can)."""
    tail_a, tail_b = a[_SCORED_FROM:], b[_SCORED_FROM:]
    norm_a = math.sqrt(math.fsum(x * x for x in tail_a))
    norm_b = math.sqrt(math.fsum(x * x for x in tail_b))
    if norm_a == 0.0 or norm_b == 0.0:
        # embedding() returns unit vectors: the dot product is the cosine.
        return math.fsum(x * y for x, y in zip(a, b, strict=True))
    return math.fsum(x * y for x, y in zip(tail_a, tail_b, strict=True)) / (norm_a * norm_b)


def pair_scores(
    query_ids: Sequence[Sequence[int]],
    document_ids: Sequence[Sequence[int]],
    *,
    use_activation: bool | None = None,
) -> list[float]:
    """Each pair's score: sigmoid(LOGIT_SCALE * cosine + LOGIT_BIAS) of the pseudo-embeddings,
    or the logit itself when `use_activation` is False (None is the pooler's default: on).
    The ids are the texts' own, without special tokens."""
    queries = [(bool(q), embedding(q)) for q in query_ids]
    if len(queries) == 1:
        queries = queries * len(document_ids)
    scores: list[float] = []
    for (has_tokens, query), document in zip(queries, document_ids, strict=True):
        # An empty text relates to nothing (its pseudo-embedding is a fixed placeholder).
        cosine = 0.0
        if has_tokens and document:
            cosine = max(-1.0, min(1.0, _cosine(query, embedding(document))))
        logit = LOGIT_SCALE * cosine + LOGIT_BIAS
        score = logit if use_activation is False else 1.0 / (1.0 + math.exp(-logit))
        scores.append(_float32(score))
    return scores


def request_id_of(request_id: str | None) -> str:
    """vLLM's id for a scoring answer: `score-` and the request's id or 16 random hex digits."""
    if request_id is None:
        request_id = f"{uuid.uuid4().int & _MASK64:016x}"
    return f"score-{request_id}"


def rerank_object(
    request_id: str,
    model: str,
    documents: Sequence[str],
    scores: Sequence[float],
    top_n: int,
    num_prompt_tokens: int,
) -> dict[str, Any]:
    """vLLM's RerankResponse: results by relevance, highest first, the first `top_n` (0: all)."""
    # sorted() is stable with reverse=True too: equal scores keep the documents' order.
    order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
    if 0 < top_n < len(order):
        del order[top_n:]
    results = [
        {
            "index": i,
            "document": {"text": documents[i], "multi_modal": None},
            "relevance_score": scores[i],
        }
        for i in order
    ]
    return {
        "id": request_id,
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
        "results": results,
    }


def score_object(
    request_id: str, model: str, scores: Sequence[float], num_prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's ScoreResponse, its UsageInfo dumped whole."""
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
        "usage": {
            "prompt_tokens": num_prompt_tokens,
            "total_tokens": num_prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
