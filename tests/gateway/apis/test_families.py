"""The families' table and ``match``: each documented route found, every other method a 405
in its family's shape, every other path a 404 naming what is served, exact paths answered by
objects built once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.errors import MAX_ECHO_CHARS
from llmgw.gateway.apis.families import (
    CHAT,
    COUNT_TOKENS,
    EMBEDDINGS,
    FAMILIES,
    MESSAGES,
    RESPONSES,
    Match,
    Miss,
    credential,
    engine_path,
    match,
    public_routes,
    routes_of,
)

# The issue's table, written out: (api, generates, group, error shape).
EXPECTED = {
    ("chat", True, "generate", "openai"),
    ("completions", True, "generate", "openai"),
    ("responses", True, "generate", "openai"),
    ("messages", True, "generate", "anthropic"),
    ("count_tokens", False, "generate", "anthropic"),
    ("embeddings", False, "pooling", "openai"),
    ("rerank", False, "pooling", "openai"),
    ("score", False, "pooling", "openai"),
}
ROUTES = [
    ("POST", "/v1/chat/completions", "chat", "create"),
    ("POST", "/v1/completions", "completions", "create"),
    ("POST", "/v1/responses", "responses", "create"),
    ("GET", "/v1/responses/resp_abc", "responses", "retrieve"),
    ("POST", "/v1/responses/resp_abc/cancel", "responses", "cancel"),
    ("POST", "/v1/messages", "messages", "create"),
    ("POST", "/v1/messages/count_tokens", "count_tokens", "create"),
    ("POST", "/v1/embeddings", "embeddings", "create"),
    ("POST", "/v1/rerank", "rerank", "create"),
    ("POST", "/v1/score", "score", "create"),
]


def test_the_table_is_the_issues() -> None:
    assert {(f.api, f.generates, f.group, f.errors) for f in FAMILIES} == EXPECTED
    assert len({f.api for f in FAMILIES}) == len(FAMILIES)
    # Anthropic's clients send their key as x-api-key; no other family takes it.
    assert {f.api for f in FAMILIES if f.x_api_key} == {"messages", "count_tokens"}


@pytest.mark.parametrize(("method", "path", "api", "operation"), ROUTES)
def test_each_route_is_found(method: str, path: str, api: str, operation: str) -> None:
    found = match(method, path)
    assert isinstance(found, Match)
    assert (found.family.api, found.route.operation) == (api, operation)
    assert found.response_id == ("resp_abc" if "resp_abc" in path else None)


def test_only_a_generating_familys_create_generates() -> None:
    generating = {
        (m.family.api, m.route.operation)
        for method, path, _, _ in ROUTES
        if isinstance(m := match(method, path), Match) and m.generates
    }
    assert generating == {
        ("chat", "create"),
        ("completions", "create"),
        ("responses", "create"),
        ("messages", "create"),
    }


def test_an_exact_path_is_answered_by_one_object_built_at_import() -> None:
    # The hot path's cost: a dict probe and a method probe, nothing allocated per request.
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/embeddings"):
        assert match("POST", path) is match("POST", "".join(path))


@pytest.mark.parametrize(
    ("method", "path", "allow", "family"),
    [
        ("GET", "/v1/chat/completions", "POST", CHAT),
        ("PUT", "/v1/messages", "POST", MESSAGES),
        ("GET", "/v1/messages/count_tokens", "POST", COUNT_TOKENS),
        ("DELETE", "/v1/embeddings", "POST", EMBEDDINGS),
        ("GET", "/v1/responses", "POST", RESPONSES),
        ("POST", "/v1/responses/resp_abc", "GET", RESPONSES),
        ("GET", "/v1/responses/resp_abc/cancel", "POST", RESPONSES),
        ("HEAD", "/v1/responses/resp_abc", "GET", RESPONSES),
    ],
)
def test_another_method_is_a_405_in_the_familys_shape(
    method: str, path: str, allow: str, family: object
) -> None:
    miss = match(method, path)
    assert isinstance(miss, Miss)
    assert (miss.status, miss.code, miss.allow, miss.family) == (
        405,
        "method_not_allowed",
        allow,
        family,
    )
    assert miss.message == f"{method} is not allowed on {path}; allowed: {allow}"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/responses/",
        "/v1/responses//cancel",
        "/v1/responses/a/b",
        "/v1/responses/a/cancel/x",
        "/v1/chat/completions/",
        "/v1/messages/count",
        "/v2/rerank",
        "/",
    ],
)
def test_any_other_path_is_a_404_naming_what_is_served(path: str) -> None:
    miss = match("POST", path)
    assert isinstance(miss, Miss)
    assert (miss.status, miss.code, miss.allow, miss.family) == (404, "unknown_url", "", None)
    assert miss.message.startswith(f"no such path: POST {path}; this listener serves ")
    for route in ("GET /v1/models", "POST /v1/responses/{id}/cancel", "POST /v1/score"):
        assert route in miss.message


@given(st.text(max_size=600), st.text(max_size=300))
def test_match_never_raises_and_never_echoes_much(method: str, path: str) -> None:
    found = match(method, path)
    if isinstance(found, Miss):
        # The path and method are clipped: a hostile 1 MB path is not a 1 MB answer.
        assert len(found.message) < 2 * MAX_ECHO_CHARS + 1000
    else:
        assert found.route.method == method


def test_routes_of_a_group_are_the_ones_a_404_names() -> None:
    assert routes_of(["pooling"]) == "POST /v1/embeddings, POST /v1/rerank, POST /v1/score"
    generate = routes_of(["generate"])
    assert "POST /v1/messages/count_tokens" in generate and "/v1/embeddings" not in generate
    assert routes_of([]) == ""


def test_engine_path_puts_the_engines_id_where_the_wrapped_one_was() -> None:
    retrieve, cancel = RESPONSES.routes[1], RESPONSES.routes[2]
    assert engine_path(retrieve, "resp_1") == "/v1/responses/resp_1"
    assert engine_path(cancel, "resp_1") == "/v1/responses/resp_1/cancel"
    assert engine_path(RESPONSES.routes[0]) == "/v1/responses"
    with pytest.raises(ValueError, match=r"response_ids\.unwrap"):
        engine_path(retrieve)


def test_the_key_comes_from_authorization_or_on_anthropics_routes_x_api_key() -> None:
    assert credential(MESSAGES, None, "llmgw_a_b") == "Bearer llmgw_a_b"
    assert credential(COUNT_TOKENS, None, "llmgw_a_b") == "Bearer llmgw_a_b"
    # Authorization wins: one request is never two keys'.
    assert credential(MESSAGES, "Bearer llmgw_c_d", "llmgw_a_b") == "Bearer llmgw_c_d"
    # OpenAI's routes read Authorization only.
    assert credential(CHAT, None, "llmgw_a_b") is None
    assert credential(EMBEDDINGS, "Bearer x", None) == "Bearer x"
    assert credential(MESSAGES, None, "") is None


def test_the_documented_routes_are_the_ones_matched() -> None:
    rows = public_routes()
    listed = [(r["method"], r["path"]) for r in rows]
    assert len(listed) == len(set(listed))
    # Every family's route is listed, under its api, and each listed route matches it.
    for family in FAMILIES:
        for route in family.routes:
            row = rows[listed.index((route.method, route.path))]
            assert row["api"] == family.api and row["errors"] == family.errors
            found = match(route.method, route.path.replace("{id}", "resp_abc"))
            assert isinstance(found, Match) and found.family is family
    assert ("GET", "/v1/models") in listed
    anthropic_key = {r["path"] for r in rows if "x-api-key" in r["key"]}
    assert anthropic_key == {"/v1/messages", "/v1/messages/count_tokens"}
