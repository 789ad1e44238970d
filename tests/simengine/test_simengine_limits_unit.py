"""The body limits as pure functions: nesting depth on raw bytes, and JSON parsing's refusals."""

from __future__ import annotations

import json

import pytest

from llmgw.bodies import MAX_JSON_DEPTH, json_depth_exceeds
from llmgw.errors import SpecError
from llmgw.simengine.limits import parse_json_body


def _nested(depth: int) -> bytes:
    """Objects and arrays alternating, `depth` levels (built as text: json.dumps would recurse)."""
    opens = "".join('{"k":' if level % 2 == 0 else "[" for level in range(depth))
    closes = "".join("}" if level % 2 == 0 else "]" for level in reversed(range(depth)))
    return (opens + "1" + closes).encode()


@pytest.mark.parametrize("depth", [0, 1, 2, 63, 64])
def test_depth_up_to_the_limit_is_accepted(depth: int) -> None:
    assert not json_depth_exceeds(_nested(depth), MAX_JSON_DEPTH)
    parse_json_body(_nested(depth))


@pytest.mark.parametrize("depth", [65, 66, 1000, 100_000])
def test_depth_past_the_limit_is_refused_before_parsing(depth: int) -> None:
    assert json_depth_exceeds(_nested(depth), MAX_JSON_DEPTH)
    with pytest.raises(SpecError, match="more than 64 levels"):
        parse_json_body(_nested(depth))


def test_brackets_inside_strings_and_escapes_do_not_count() -> None:
    tricky = json.dumps({"a": ['[[[{{{"\\' * 50, "]]]" * 50], "b": [[1], [2], [3]] * 40}).encode()
    assert not json_depth_exceeds(tricky, MAX_JSON_DEPTH)
    assert parse_json_body(tricky)["b"][0] == [1]


def test_many_shallow_siblings_are_not_deep() -> None:
    wide = json.dumps([[[i]] for i in range(100_000)]).encode()
    assert not json_depth_exceeds(wide, MAX_JSON_DEPTH)


@pytest.mark.parametrize("body", [b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}', b"{no"])
def test_non_json_is_a_spec_error(body: bytes) -> None:
    with pytest.raises(SpecError, match="not JSON"):
        parse_json_body(body)
