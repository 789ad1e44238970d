"""The body limits as pure functions: nesting depth and lone surrogates on raw bytes, and JSON
parsing's refusals."""

from __future__ import annotations

import json

import pytest

from llmgw.errors import SpecError
from llmgw.http.bodies import (
    MAX_JSON_DEPTH,
    BadJson,
    check_json,
    json_depth_exceeds,
    lone_surrogate,
    parse_json,
)
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


# Each as a client writes it: the escape as JSON text.
@pytest.mark.parametrize(
    ("body", "lone"),
    [
        (rb'{"p": "\ud800"}', r"\ud800"),
        (rb'{"p": "\uDBFF"}', r"\uDBFF"),
        (rb'{"p": "\udc00 after"}', r"\udc00"),
        (rb'{"\ud800": 1}', r"\ud800"),
        (rb'{"p": "\ud800\ud83d\ude00"}', r"\ud800"),  # a high one before a whole pair
        (rb'{"p": "\\\ud800"}', r"\ud800"),  # an escaped backslash, then the escape
        (rb'{"p": "\ud83d\\ude00"}', r"\ud83d"),  # the "low half" is text
        (rb'{"p": "\\ud83d\ude00"}', r"\ude00"),  # the "high half" is text
        (rb'{"p": "\ud83d\ude00"}', None),  # a pair: an emoji
        (rb'{"p": "\\ud800"}', None),  # a backslash, then the text "ud800"
        (rb'{"p": "\u005cud800"}', None),  # the same, the backslash escaped as \u005c
        (rb'{"p": "a\nb \u00e9"}', None),
        (b'{"p": "plain"}', None),
    ],
)
def test_a_lone_surrogate_is_found_on_the_raw_bytes(body: bytes, lone: str | None) -> None:
    assert lone_surrogate(body) == lone
    # The truth: whether what Python's parser makes of the body can be encoded.
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        assert lone is not None
    else:
        assert lone is None
    if lone is not None:
        with pytest.raises(BadJson, match="lone UTF-16 surrogate"):
            parse_json(body)
        with pytest.raises(BadJson, match="lone UTF-16 surrogate"):
            check_json(body)


def test_text_must_be_utf8() -> None:
    with pytest.raises(BadJson, match="not UTF-8"):
        parse_json(b'{"p": "\xed\xa0\x80"}')  # an encoded surrogate: Python's parser took it
    with pytest.raises(BadJson, match="not UTF-8"):
        parse_json(b'{"p": "\xff"}')
    assert parse_json(b'\xef\xbb\xbf{"p": "\xc3\xa9"}') == {"p": "é"}  # a BOM is skipped


@pytest.mark.parametrize("body", [b'{"t": NaN}', b'{"t": [1, -Infinity]}', b"Infinity"])
def test_check_json_refuses_what_parse_json_refuses(body: bytes) -> None:
    with pytest.raises(BadJson, match="send a finite number"):
        parse_json(body)
    with pytest.raises(BadJson, match="send a finite number"):
        check_json(body)


def test_check_json_refuses_deep_bodies() -> None:
    check_json(_nested(64))
    with pytest.raises(BadJson, match="more than 64 levels"):
        check_json(_nested(65))


def test_check_json_passes_the_words_inside_strings() -> None:
    check_json(json.dumps({"NaN": "Infinity", "t": "[[[[", "e": "\U0001f600"}).encode())
