"""Response ids that name their replica: round trips, every alteration refused, secrets and
keys kept apart, and the ids in bodies and streams rewritten both ways."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.gateway.apis.chat_parts import Refused
from llmgw.gateway.apis.response_ids import (
    MAX_ID_CHARS,
    PREFIX,
    EngineRef,
    ResponseIdRefused,
    ResponseIds,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
IDS = ResponseIds([SECRET])
REPLICA = "3f6c1b9e-8c1d-4c39-9b1e-2a7f0c5d4e11"
ENGINE_ID = "resp_8d5e0f3a9b7c4e21a6f0d9c8b7a61234"


def _decode(wrapped: str) -> bytes:
    body = wrapped[len(PREFIX) :]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def _encode(raw: bytes) -> str:
    return PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


replicas = st.text(min_size=1, max_size=16).filter(lambda r: 1 <= len(r.encode()) <= 64)
engine_ids = st.from_regex(r"[A-Za-z0-9_-]{1,256}", fullmatch=True)
scopes = st.text(max_size=40)


@given(replicas, engine_ids, scopes)
def test_an_id_unwraps_to_what_was_wrapped(replica: str, engine_id: str, scope: str) -> None:
    wrapped = IDS.wrap(replica, engine_id, scope=scope)
    assert wrapped.startswith(PREFIX) and len(wrapped) <= MAX_ID_CHARS
    assert IDS.unwrap(wrapped, scope=scope) == EngineRef(replica, engine_id)
    # Any gateway of the cluster reads it: nothing but the secret is shared.
    assert ResponseIds([SECRET]).unwrap(wrapped, scope=scope).engine_id == engine_id


@given(engine_ids, st.data())
def test_any_changed_character_is_refused(engine_id: str, data: st.DataObject) -> None:
    wrapped = IDS.wrap(REPLICA, engine_id)
    at = data.draw(st.integers(0, len(wrapped) - 1))
    other = data.draw(st.characters(codec="utf-8").filter(lambda c: c != wrapped[at]))
    with pytest.raises(ResponseIdRefused):
        IDS.unwrap(wrapped[:at] + other + wrapped[at + 1 :])


@given(engine_ids, st.data())
def test_any_changed_byte_is_refused(engine_id: str, data: st.DataObject) -> None:
    # At the byte level, re-encoded canonically: only the tag can tell, and it does.
    raw = bytearray(_decode(IDS.wrap(REPLICA, engine_id)))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ResponseIdRefused) as refused:
        IDS.unwrap(_encode(bytes(raw)))
    assert refused.value.cause in ("forged", "unknown_version", "malformed")


def test_the_last_characters_unused_bits_are_refused_too() -> None:
    # 2 + 36 + 8 + 38 + 16 = 100 bytes: the last base64 character carries 4 unused bits.
    wrapped = IDS.wrap(REPLICA, ENGINE_ID + "x")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(wrapped[-1])
    twin = wrapped[:-1] + alphabet[last ^ 1]  # decodes to the same bytes without the check
    assert _decode(twin) == _decode(wrapped)
    with pytest.raises(ResponseIdRefused) as refused:
        IDS.unwrap(twin)
    assert refused.value.cause == "malformed"


@given(engine_ids, st.data())
def test_a_truncated_id_is_refused(engine_id: str, data: st.DataObject) -> None:
    wrapped = IDS.wrap(REPLICA, engine_id)
    cut = data.draw(st.integers(0, len(wrapped) - 1))
    with pytest.raises(ResponseIdRefused):
        IDS.unwrap(wrapped[:cut])


@given(replicas, engine_ids, st.binary(min_size=32, max_size=64))
def test_another_secret_refuses_it(replica: str, engine_id: str, secret: bytes) -> None:
    wrapped = IDS.wrap(replica, engine_id)
    if secret != SECRET:
        with pytest.raises(ResponseIdRefused) as refused:
            ResponseIds([secret]).unwrap(wrapped)
        assert refused.value.cause == "forged"


@given(engine_ids, scopes, scopes)
def test_another_key_refuses_it(engine_id: str, scope: str, other: str) -> None:
    wrapped = IDS.wrap(REPLICA, engine_id, scope=scope)
    if other != scope:
        with pytest.raises(ResponseIdRefused) as refused:
            IDS.unwrap(wrapped, scope=other)
        assert refused.value.cause == "forged"


def test_rotation_the_first_secret_signs_and_every_one_verifies() -> None:
    old = IDS.wrap(REPLICA, ENGINE_ID)
    rotated = ResponseIds([OTHER, SECRET])
    assert rotated.unwrap(old) == EngineRef(REPLICA, ENGINE_ID)
    new = rotated.wrap(REPLICA, ENGINE_ID)
    assert new != old and ResponseIds([OTHER]).unwrap(new).engine_id == ENGINE_ID
    with pytest.raises(ResponseIdRefused):
        IDS.unwrap(new)


NO_MARK = bytes(8)  # an engine mark of a gateway that knew no incarnation


def _signed(payload: bytes, scope: str = "") -> str:
    """An id signed with SECRET as wrap signs, around any payload (what wrap never writes)."""
    mac = hmac.new(SECRET, b"llmgw/response-id/v1\x00", hashlib.sha256)
    mac.update(len(scope.encode()).to_bytes(4, "big") + scope.encode() + payload)
    return _encode(payload + mac.digest()[:16])


@pytest.mark.parametrize(
    ("wrapped", "cause"),
    [
        ("x" * (MAX_ID_CHARS + 1), "too_long"),
        (ENGINE_ID, "truncated"),  # an engine's raw id: base64url-shaped, shorter than ours
        ("resp_", "malformed"),
        ("msg_abcdef", "malformed"),
        ("resp_abc$def", "malformed"),
        ("resp_abcde", "malformed"),  # 5 characters: no base64 length
        ("resp_AAAA", "truncated"),
        (_signed(b"\x02\x01r" + NO_MARK + b"a"), "unknown_version"),
        # Signed, but its replica overruns the id.
        (_signed(b"\x01\x05r" + NO_MARK + b"a"), "malformed"),
        # Signed, but no engine id of the alphabet.
        (_signed(b"\x01\x01r" + NO_MARK + b"../x"), "malformed"),
    ],
)
def test_each_cause_is_named(wrapped: str, cause: str) -> None:
    with pytest.raises(ResponseIdRefused) as refused:
        IDS.unwrap(wrapped, field="previous_response_id")
    assert refused.value.cause == cause
    assert refused.value.status == 404  # as the engine answers an id it does not hold
    assert refused.value.field == "previous_response_id"
    assert "POST /v1/responses returned it" in refused.value.message
    assert len(refused.value.message) < 700  # the id is quoted clipped


@pytest.mark.parametrize(
    "engine_id", ["", "resp/../admin", "resp_1?x=1", "..", "a.b", "x" * 257, "résumé"]
)
def test_an_engine_id_no_url_path_may_hold_is_never_wrapped(engine_id: str) -> None:
    with pytest.raises(ValueError, match="cannot be wrapped"):
        IDS.wrap(REPLICA, engine_id)


def test_the_longest_id_is_the_cap() -> None:
    longest = IDS.wrap("r" * 64, "e" * 256)
    assert len(longest) == MAX_ID_CHARS
    assert IDS.unwrap(longest) == EngineRef("r" * 64, "e" * 256)
    with pytest.raises(ValueError, match="replica"):
        IDS.wrap("r" * 65, "e")


@pytest.mark.parametrize("secrets", [[], [b"short"], [SECRET, b"x" * 31]])
def test_a_weak_or_missing_secret_is_refused(secrets: list[bytes]) -> None:
    with pytest.raises(ValueError, match="secret"):
        ResponseIds(secrets)


# --- bodies and streams -------------------------------------------------------------------


def test_an_incoming_body_names_its_replica_and_carries_the_engines_id() -> None:
    body: dict[str, Any] = {
        "input": "next",
        "previous_response_id": IDS.wrap(REPLICA, ENGINE_ID, scope="key1"),
        "request_id": "resp_chosen_by_the_client",
    }
    assert IDS.for_engine(body, scope="key1") == EngineRef(REPLICA, ENGINE_ID)
    assert body == {"input": "next", "previous_response_id": ENGINE_ID}
    fresh: dict[str, Any] = {"input": "first", "request_id": "x", "previous_response_id": None}
    assert IDS.for_engine(fresh) is None
    assert "request_id" not in fresh


def test_an_incoming_body_with_a_bad_previous_id_is_refused() -> None:
    with pytest.raises(Refused) as refused:
        IDS.for_engine({"previous_response_id": 5})
    assert refused.value.field == "previous_response_id"
    forged = IDS.wrap(REPLICA, ENGINE_ID, scope="key1")
    with pytest.raises(ResponseIdRefused):
        IDS.for_engine({"previous_response_id": forged}, scope="key2")


def test_a_whole_answer_carries_wrapped_ids_only() -> None:
    answer = {
        "id": ENGINE_ID,
        "object": "response",
        "previous_response_id": "resp_previous",
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "content": [{"type": "output_text", "text": "héllo \ud800"}],
            }
        ],
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    raw = json.dumps(answer).encode()
    out = json.loads(IDS.rewrite_answer(raw, REPLICA))
    assert IDS.unwrap(out["id"]) == EngineRef(REPLICA, ENGINE_ID)
    assert IDS.unwrap(out["previous_response_id"]) == EngineRef(REPLICA, "resp_previous")
    assert out["output"] == answer["output"]  # the text, a lone surrogate included, intact
    assert IDS.rewrite_answer(b"not json", REPLICA) == b"not json"
    error = b'{"error": {"message": "not found"}}'
    assert IDS.rewrite_answer(error, REPLICA) is error


def _stream(named: bool) -> list[bytes]:
    def event(name: str, data: dict[str, Any]) -> bytes:
        head = f"event: {name}\n" if named else ""
        return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    response = {"id": ENGINE_ID, "object": "response", "previous_response_id": None}
    return [
        event("response.created", {"type": "response.created", "response": response}),
        event("response.in_progress", {"type": "response.in_progress", "response": response}),
        event(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "delta": "ünï response.completed"},
        ),
        event(
            "response.completed",
            {"type": "response.completed", "response": {**response, "status": "completed"}},
        ),
    ]


@pytest.mark.parametrize("named", [True, False])
def test_every_streamed_event_carrying_the_response_is_rewritten(named: bool) -> None:
    events = _stream(named)
    out = IDS.rewrite_events(b"".join(events), REPLICA)
    rewritten = [e + b"\n\n" for e in out.split(b"\n\n") if e]
    assert len(rewritten) == 4
    assert rewritten[2] == events[2]  # a delta passes as it came
    for event in (rewritten[0], rewritten[1], rewritten[3]):
        assert event.startswith(b"event: response.") == named
        data = json.loads(event.split(b"data: ", 1)[1])
        assert IDS.unwrap(data["response"]["id"]) == EngineRef(REPLICA, ENGINE_ID)
        assert data["response"]["previous_response_id"] is None
    assert ENGINE_ID.encode() not in out


def test_a_read_without_such_an_event_is_passed_on_untouched() -> None:
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    deltas = delta * 3
    assert IDS.rewrite_events(deltas, REPLICA) is deltas  # not even split
    # Text that names an event is text: passed on as it came.
    trap = _stream(True)[2] + _stream(False)[2]
    assert b"response.completed" in trap
    assert IDS.rewrite_events(trap, REPLICA) is trap


@given(engine_ids, st.text(min_size=1, max_size=80), st.text(min_size=1, max_size=80))
def test_an_id_knows_the_engine_process_that_stored_it(
    engine_id: str, incarnation: str, later: str
) -> None:
    ref = IDS.unwrap(IDS.wrap(REPLICA, engine_id, incarnation=incarnation))
    assert (ref.replica, ref.engine_id) == (REPLICA, engine_id)
    assert not ref.restarted(incarnation)
    # Another process of the same replica (restarted in place) holds none of its responses.
    assert ref.restarted(later) == (later != incarnation)
    # Where either side knew no process, the engine answers for itself.
    assert not ref.restarted("")
    assert not IDS.unwrap(IDS.wrap(REPLICA, engine_id)).restarted(later)
