"""The two depth checks of llmgw.http.bodies agree: on the bytes (``json_depth_exceeds``, for
listeners whose parser is another one) and on the parsed value (``nests_deeper_than``, which
``parse_json`` uses for bodies of many brackets: the bytes' check strips every string first,
the cost that held the gateway's loop on a chat of many small messages)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.http.bodies import BadJson, json_depth_exceeds, nests_deeper_than, parse_json

# Strings full of brackets and escapes: they must never count as nesting.
_TEXT = st.text(alphabet='[]{}"\\ab', max_size=6)
_JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(value=_JSON, limit=st.integers(min_value=1, max_value=8))
def test_the_parsed_and_the_bytes_checks_agree(value: Any, limit: int) -> None:
    body = json.dumps(value).encode()
    deep = json_depth_exceeds(body, limit)
    assert nests_deeper_than(value, limit) == deep
    if deep:
        with pytest.raises(BadJson, match=f"more than {limit} levels"):
            parse_json(body, max_depth=limit)
    else:
        assert parse_json(body, max_depth=limit) == value


@pytest.mark.parametrize("body", [b"[" * 5000 + b"]" * 5000, b"[" * 5000, b'{"a":' * 3000])
def test_past_the_interpreters_recursion_limit_is_too_deep_not_a_500(body: bytes) -> None:
    with pytest.raises(BadJson, match="levels deep"):
        parse_json(body)
