"""YAML documents are read without anchors, aliases or duplicate keys, and bounded
(hardening-3 finding 13): the 472-byte alias bomb that `llmgw apply` once expanded to 3 GB,
and `replicas: 2` then `replicas: 0` that applied 0."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw import documents
from llmgw.documents import MAX_DEPTH, MAX_NODES, load_yaml, parse_documents, read_documents
from llmgw.errors import SpecError

# The classic "billion laughs": nine levels of nine aliases each.
BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(
            f"{chr(ord('b') + i)}: &{chr(ord('b') + i)} ["
            + ",".join([f"*{chr(ord('a') + i)}"] * 9)
            + "]"
            for i in range(8)
        ),
    ]
)


def _refusal(text: str) -> str:
    with pytest.raises(SpecError) as info:
        parse_documents(text, "fleet.yaml")
    assert info.value.field == "-f"
    return info.value.message


def test_the_alias_bomb_is_refused_before_it_is_built() -> None:
    assert len(BOMB.encode()) < 600
    started = time.monotonic()
    message = _refusal(BOMB)
    assert time.monotonic() - started < 1
    assert message.startswith("fleet.yaml: line 1: an anchor (&a) is not accepted")
    assert "write the value out in full" in message


def test_an_alias_alone_is_refused_naming_its_line() -> None:
    # Refused as an alias, before the composer would look its anchor up.
    message = _refusal("kind: model\nname: m\ndescription: *d\n")
    assert "line 3" in message and "alias (*d)" in message


def test_duplicate_keys_are_refused_naming_both_lines() -> None:
    text = "kind: deployment\nname: d\nreplicas: 2\nreplicas: 0\n"
    message = _refusal(text)
    assert "line 4: key 'replicas' is given twice in one mapping (first on line 3)" in message
    assert "remove the one you do not mean" in message


def test_duplicate_keys_in_flow_style_and_nested_mappings() -> None:
    assert "key 'a' is given twice" in _refusal("{a: 1, a: 2}")
    nested = "kind: profile\nname: p\nenv:\n  X: '1'\n  X: '2'\n"
    assert "line 5: key 'X' is given twice" in _refusal(nested)
    # The same key in two mappings (two documents, two list items) is no duplicate.
    ok = "kind: model\nname: a\n---\nkind: model\nname: b\nx: [{k: 1}, {k: 2}]\n"
    docs, positions = parse_documents(ok, "f")
    assert [d["name"] for d in docs] == ["a", "b"] and positions == [1, 2]


def test_values_and_depth_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_NODES == 200_000
    monkeypatch.setattr(documents, "MAX_NODES", 1000)  # the same check, a faster test
    too_many = "- " + "\n- ".join(["x"] * 1000)
    assert "line 1000: the file holds more than 1000 values; split it" in _refusal(too_many)
    # A mapping (1) of one key (2) and a list (3) of 997 items: 1000 values, the bound.
    assert len(parse_documents("a:\n- " + "\n- ".join(["x"] * 997), "f")[0][0]["a"]) == 997
    deep = "a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)
    assert "nests too deeply" in _refusal(deep)
    fine = "a: " + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    assert parse_documents(fine, "f")[0]


def test_ordinary_files_read_as_before(tmp_path: Path) -> None:
    demo = Path(__file__).resolve().parents[2] / "config" / "demo.yaml"
    docs, _ = read_documents(str(demo))
    assert {d["kind"] for d in docs} == {"model", "profile", "deployment"}
    path = tmp_path / "f.yaml"
    path.write_text("kind: model\nname: m\n---\n- not a mapping\n")
    with pytest.raises(SpecError, match="document 2: is a list"):
        read_documents(str(path))
    with pytest.raises(SpecError, match="not valid YAML at line"):
        parse_documents("a: [1, 2\n", "f")


def test_load_yaml_reads_one_document_with_the_same_rules() -> None:
    assert load_yaml("a: 1\n", "spec.yaml") == {"a": 1}
    assert load_yaml("", "spec.yaml") is None
    with pytest.raises(SpecError, match=r"spec\.yaml: line 2: key 'a' is given twice"):
        load_yaml("a: 1\na: 2\n", "spec.yaml")
    with pytest.raises(SpecError, match="holds 2 YAML documents"):
        load_yaml("a: 1\n---\nb: 2\n", "spec.yaml")
