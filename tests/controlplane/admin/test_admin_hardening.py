"""The admin API as an attacker and a careless client meet it, over real HTTP against a real
`llmgw controlplane` process: authentication before the body, a streamed body cap, text
bounds, lone surrogates, dot-segment names, secrets kept out of logs and replies, and the
small things (415, Allow, one code per kind of error, pages, offline /docs)."""

from __future__ import annotations

import json
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest

from llmgw.embedded_postgres import libpq_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

_MB = 1024 * 1024


@pytest.fixture
def client(controlplane: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=controlplane.url, headers=controlplane.headers, timeout=10) as c:
        yield c


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _raw(url: str, request: bytes, *, timeout_s: float = 10) -> tuple[int, bytes]:
    """Send ``request`` as is (no client-side path normalisation) and read one response."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as s:
        s.sendall(request)
        return _read_response(s)


def _read_response(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    want = int(match.group(1)) if match else 0
    while len(body) < want:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def _json_ascii(body: Any) -> bytes:
    # ensure_ascii keeps a lone surrogate as the "\ud800" escape a hostile client would send.
    return json.dumps(body, ensure_ascii=True).encode()


# --- 2. authenticate first, then read at most the cap ------------------------------------


def test_unauthenticated_body_is_refused_before_it_is_read(controlplane: Any) -> None:
    parts = urlsplit(controlplane.url)
    size = 20 * _MB
    rss_before = _rss_bytes(controlplane.proc.pid)
    got_reply = threading.Event()
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(
            b"POST /admin/v1/models HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {size}\r\n\r\n".encode()
            + b"{" * 65536
        )

        def send_rest() -> None:
            # Only once the reply is in: it must come before the body does.
            got_reply.wait(timeout=15)
            try:
                sent = 65536
                while sent < size:
                    s.sendall(b"{" * 65536)
                    sent += 65536
            except OSError:
                pass  # the server may close once it has answered

        sender = threading.Thread(target=send_rest)
        sender.start()
        try:
            status, body = _read_response(s)
        finally:
            got_reply.set()
            sender.join(timeout=30)
    assert status == 401, body
    assert json.loads(body)["error"]["code"] == "unauthorized"
    growth = _rss_bytes(controlplane.proc.pid) - rss_before
    assert growth < 5 * _MB, f"RSS grew by {growth} bytes for a refused 20 MB body"


def test_malformed_unauthenticated_body_is_401_not_400(controlplane: Any) -> None:
    r = httpx.post(
        f"{controlplane.url}/admin/v1/models",
        content=b'{"name": ',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"


def test_a_body_over_the_cap_is_413_declared_or_streamed(
    client: httpx.Client, controlplane: Any
) -> None:
    big = _json_ascii({"name": "m-big", "description": "x" * (2 * _MB)})
    rss_before = _rss_bytes(controlplane.proc.pid)
    r = client.post("/admin/v1/models", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body-too-large"
    assert "controlplane.admin_max_body_bytes" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap must hold while streaming
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    r = client.post(
        "/admin/v1/models", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert _rss_bytes(controlplane.proc.pid) - rss_before < 5 * _MB


def test_text_fields_are_bounded_naming_the_bound(client: httpx.Client) -> None:
    r = client.post("/admin/v1/models", json={"name": "m-long", "description": "x" * 900_000})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "description" and "4096" in err["message"]
    base = {"name": "p-long", "model": "m", "engine": "sim", "model_path": "/m"}
    for extra, field, bound in [
        ({"args": ["--x"] * 513}, "args", "512"),
        ({"args": ["x" * 4097]}, "args.0", "4096"),
        ({"env": {"A": "x" * 8193}}, "env.A", "8192"),
        ({"secret_env": {"A": "x" * 1025}}, "secret_env.A", "1024"),
        ({"env": {f"K{i}": "v" for i in range(257)}}, "env", "256"),
        ({"adapters": [{"name": "a", "path": "x" * 4097}]}, "adapters.0.path", "4096"),
    ]:
        r = client.post("/admin/v1/profiles", json={**base, **extra})
        assert r.status_code == 422, (field, r.text)
        err = r.json()["error"]
        assert err["field"] == field and bound in err["message"], (field, err)


# --- 3. lone surrogates and secrets --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/admin/v1/models", {"name": "m-s", "description": "a\ud800b"}, "description"),
        ("/admin/v1/profiles", {"args": ["--x", "\ud800"]}, "args.1"),
        ("/admin/v1/profiles", {"env": {"A": "\udfff"}}, "env.A"),
        ("/admin/v1/profiles", {"secret_env": {"A": "vault:\ud800"}}, "secret_env.A"),
        ("/admin/v1/profiles", {"served_model_name": "\ud800"}, "served_model_name"),
        ("/admin/v1/profiles", {"adapters": [{"name": "a", "path": "/\ud800"}]}, "adapters.0.path"),
        ("/admin/v1/models", {"name": "m\ud800"}, "name"),
    ],
)
def test_a_lone_surrogate_is_422_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    if path.endswith("profiles"):
        body = {"name": "p-s", "model": "m", "engine": "sim", "model_path": "/m", **body}
    r = client.post(path, content=_json_ascii(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field, r.text
    assert "lone surrogate" in r.json()["error"]["message"], r.text


def _nested(depth: int) -> bytes:
    # Built as text: json.dumps would recurse.
    return b'{"name": "m-deep", "description": ' + b"[" * depth + b"]" * depth + b"}"


def test_deep_and_non_finite_bodies_are_a_400_before_the_parse(client: httpx.Client) -> None:
    json_header = {"Content-Type": "application/json"}
    for depth in (970, 100_000):
        r = client.post("/admin/v1/models", content=_nested(depth), headers=json_header)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "malformed-json" and "more than 64 levels" in err["message"]
    r = client.post(
        "/admin/v1/deployments/none/scale", content=b'{"replicas": NaN}', headers=json_header
    )
    assert r.status_code == 400 and "NaN is not valid JSON" in r.text, r.text
    # The words inside strings are text: the body passes to the API's own checks.
    r = client.post(
        "/admin/v1/models",
        content=b'{"name": "m-words", "description": "NaN Infinity [[[ \\\\ud800"}',
        headers=json_header,
    )
    assert r.status_code == 201, r.text


def test_a_lone_surrogate_in_a_free_form_field_is_422_naming_it(client: httpx.Client) -> None:
    """apply's documents are free-form JSON: nothing in the schema checks their strings."""
    for doc, field in (
        ({"kind": "model", "name": "m-a", "description": "\ud800"}, "documents.0.description"),
        ({"kind": "model", "name": "m-b", "\udc00": 1}, "documents.0.\\udc00"),
    ):
        r = client.post(
            "/admin/v1/apply",
            content=_json_ascii({"documents": [doc]}),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == field and "lone surrogate" in err["message"], err


def test_what_a_client_sent_is_echoed_clipped(client: httpx.Client, controlplane: Any) -> None:
    """A name, path or field the client chose appears at most ~200 characters long in an
    error: as big as the listener lets in (a 60 KB path, a 1 MB body), the answer stays small."""
    long = "n" * 60_000
    answers = [
        client.get(f"/admin/v1/models/{long}"),  # no such model
        client.put(f"/admin/v1/models/{long}", json={}),  # 405
        client.get(f"/admin/v1/{long}"),  # no such path
        client.post("/admin/v1/models", json={"name": "m-x", "k" * 900_000: 1}),  # unknown field
    ]
    status, body = _raw(
        controlplane.url,
        f"GET /admin/v1/models/a//{long} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {controlplane.token}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert status == 404 and len(body) < 1500, body[:300]
    for r in answers:
        assert r.status_code in (404, 405, 422), r.text[:300]
        assert len(r.content) < 1500, (r.status_code, r.content[:300])
        err = r.json()["error"]
        assert "…" in err["message"] + (err["field"] or ""), err
    # A 4 MB name never reaches a parser: the body cap answers first, as small.
    r = client.post("/admin/v1/models", json={"name": "n" * (4 * _MB)})
    assert r.status_code == 413 and len(r.content) < 500, r.text[:300]


def test_a_planted_secret_appears_in_no_log_and_no_reply(
    client: httpx.Client, controlplane: Any
) -> None:
    secret = f"planted-{secrets.token_hex(8)}"
    model = f"m-{secrets.token_hex(3)}"
    assert client.post("/admin/v1/models", json={"name": model}).status_code == 201
    base = {"model": model, "engine": "sim", "model_path": "/m"}
    # A reference is write-only too: the planted text as a file name is never shown back.
    ref = f"file:/run/secrets/{secret}"
    bodies: list[dict[str, Any]] = [
        {**base, "name": f"p-{secrets.token_hex(3)}", "secret_env": {"HF_TOKEN": ref}},
        {**base, "name": "p-bad0", "secret_env": {"HF_TOKEN": secret}},
        {**base, "name": "p-bad1", "secret_env": {"HF_TOKEN": secret + "\ud800"}},
        {**base, "name": "p-bad2", "secret_env": {"HF_TOKEN": ref, "1BAD": "x"}},
        {**base, "name": "p-bad3", "secret_env": {"HF_TOKEN": secret * 100}},
        {**base, "name": "p-bad4", "secret_env": {"HF_TOKEN": ref}, "tp": 0},
        {**base, "name": "p-bad5", "secret_env": {"HF_TOKEN": ref}, "colour": secret},
        {**base, "name": "p-bad6", "secret_env": {"HF_TOKEN": ref}, "engine": "nope"},
    ]
    replies = []
    for body in bodies:
        r = client.post(
            "/admin/v1/profiles",
            content=_json_ascii(body),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code < 500, r.text
        replies.append(r)
    assert replies[0].status_code == 201, replies[0].text
    assert all(r.status_code in (404, 422) for r in replies[1:]), [r.text for r in replies]
    r = client.patch(
        f"/admin/v1/profiles/{bodies[0]['name']}",
        json={"version": 1, "secret_env": {"HF_TOKEN": ref + "2"}},
    )
    assert r.status_code == 200, r.text
    replies.append(r)
    replies.append(client.get(f"/admin/v1/profiles/{bodies[0]['name']}"))
    replies.append(client.get("/admin/v1/profiles"))
    for r in replies:
        assert secret not in r.text, r.text
    # The process's whole log, written by the time each reply was read (one writer, unbuffered).
    assert secret not in controlplane.log.read_text()


def _holding(db_url: str, text: str) -> list[str]:
    """The tables with a row whose text holds ``text``: where a secret could have landed."""
    found = []
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        for table in ("profiles", "deployments", "shards", "audit_log"):
            query = f"SELECT count(*) FROM {table} t WHERE t::text LIKE %s"
            row = conn.execute(query, (f"%{text}%",)).fetchone()
            if row is not None and row[0]:
                found.append(table)
    return found


def test_a_literal_secret_is_refused_before_anything_is_written(
    client: httpx.Client, controlplane: Any
) -> None:
    """A secret pasted where its reference belongs is refused by every write of a profile,
    with the agent's own words, before it reaches a row, the WAL or a node."""
    secret = f"hf_{secrets.token_hex(12)}"
    model, profile = f"m-{secrets.token_hex(3)}", f"p-{secrets.token_hex(3)}"
    base = {"model": model, "engine": "sim", "model_path": "/m"}
    assert client.post("/admin/v1/models", json={"name": model}).status_code == 201
    created = client.post(
        "/admin/v1/profiles", json={**base, "name": profile, "secret_env": {"A": "env:A"}}
    )
    assert created.status_code == 201, created.text
    want = "value is not a reference; use env:NAME or file:/path"

    replies = [
        client.post(
            "/admin/v1/profiles",
            json={**base, "name": f"p-{secrets.token_hex(3)}", "secret_env": {"HF_TOKEN": secret}},
        ),
        client.patch(
            f"/admin/v1/profiles/{profile}",
            json={"version": 1, "secret_env": {"HF_TOKEN": secret}},
        ),
    ]
    for r in replies:
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert (error["code"], error["field"]) == ("spec-invalid", "secret_env.HF_TOKEN"), error
        assert want in error["message"], error
    doc = {"kind": "profile", "name": profile, **base, "secret_env": {"HF_TOKEN": secret}}
    for dry_run in (True, False):
        r = client.post("/admin/v1/apply", json={"documents": [doc], "dry_run": dry_run})
        assert r.status_code == 422, r.text
        [problem] = r.json()["error"]["problems"]
        assert problem["field"] == "secret_env.HF_TOKEN" and want in problem["message"], problem
        replies.append(r)
    for r in replies:
        assert secret not in r.text, r.text
    assert client.get(f"/admin/v1/profiles/{profile}").json()["version"] == 1
    assert _holding(controlplane.db_url, secret) == []
    assert secret not in controlplane.log.read_text()


# --- 4. names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a/..", "a/../b", "a/.", "x/", "a//b", "a/./b", "/x", ".."])
def test_names_with_empty_or_dot_segments_are_refused(client: httpx.Client, name: str) -> None:
    r = client.post("/admin/v1/models", json={"name": name})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "name"


def test_dot_segments_in_a_path_name_never_reach_another_object(
    client: httpx.Client, controlplane: Any
) -> None:
    b = f"b-{secrets.token_hex(3)}"
    assert client.post("/admin/v1/models", json={"name": b}).status_code == 201
    auth = controlplane.headers["Authorization"].encode()
    status, body = _raw(
        controlplane.url,
        f"DELETE /admin/v1/models/a/../{b} HTTP/1.1\r\nHost: x\r\n".encode()
        + b"Authorization: "
        + auth
        + b"\r\nConnection: close\r\n\r\n",
    )
    assert status == 404, body
    assert "segment" in json.loads(body)["error"]["message"]
    assert client.get(f"/admin/v1/models/{b}").status_code == 200


def test_a_trailing_slash_lists_instead_of_naming_the_empty_model(client: httpx.Client) -> None:
    r = client.get("/admin/v1/models/")
    assert r.status_code == 200, r.text
    assert r.json()["items"] == client.get("/admin/v1/models").json()["items"]
    assert client.delete("/admin/v1/models/").status_code == 404


# --- small things ----------------------------------------------------------------------------


def test_wrong_content_type_is_415_naming_the_expected_one(client: httpx.Client) -> None:
    r = client.post("/admin/v1/models", content=b"name=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported-media-type"
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_a_bodyless_post_needs_no_content_type(client: httpx.Client) -> None:
    # `curl -X POST .../cordon` sends neither a body nor a Content-Type: an action, not a document.
    r = client.post("/admin/v1/deployments/no-such-deployment/suspend")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not-found"
    # A body without its media type is still refused.
    r = client.post("/admin/v1/deployments/no-such-deployment/suspend", content=b"{}")
    assert r.status_code == 415, r.text


def test_405_carries_allow(client: httpx.Client) -> None:
    r = client.put("/admin/v1/models/x", json={})
    assert r.status_code == 405, r.text
    assert set(r.headers["allow"].split(", ")) >= {"DELETE", "GET", "PATCH"}
    assert r.json()["error"]["code"] == "method-not-allowed"


def test_one_code_per_kind_of_error(client: httpx.Client) -> None:
    # Not JSON at all and not UTF-8: both "the body cannot be parsed", one code.
    for content in (b'{"name": ', b'{"name": "\xff"}'):
        r = client.post(
            "/admin/v1/models", content=content, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "malformed-json", r.text
    r = client.get("/admin/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not-found"


def test_lists_are_pages_with_an_opaque_cursor(client: httpx.Client) -> None:
    for _ in range(3):
        client.post("/admin/v1/models", json={"name": f"pg-{secrets.token_hex(3)}"})
    everything = [
        m["name"] for m in client.get("/admin/v1/models", params={"limit": 1000}).json()["items"]
    ]
    assert everything == sorted(everything) and len(everything) >= 3
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/admin/v1/models", params=params).json()
        assert len(page["items"]) <= 2
        seen += [m["name"] for m in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == everything
    for params, field in [
        ({"cursor": "garbage!"}, "cursor"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
    ]:
        r = client.get("/admin/v1/models", params=params)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    for kind in ("profiles", "deployments"):
        assert set(client.get(f"/admin/v1/{kind}").json()) == {"items", "next_cursor"}


def test_docs_work_offline(controlplane: Any) -> None:
    r = httpx.get(f"{controlplane.url}/docs")
    assert r.status_code == 200
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", r.text)
    assert urls, r.text
    for url in urls:
        assert not re.match(r"^(https?:)?//", url), f"/docs loads {url} from off the machine"
        assert httpx.get(f"{controlplane.url}{url}").status_code == 200, url


def test_every_request_has_an_access_line_with_its_id(controlplane: Any) -> None:
    r = httpx.get(f"{controlplane.url}/admin/v1/models", headers={"X-Request-ID": "rid-check-1"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "rid-check-1"
    forged = httpx.get(f"{controlplane.url}/healthz", headers={"X-Request-ID": 'a"b c'})
    assert forged.headers["x-request-id"] != 'a"b c'  # not a sane token: a fresh id instead
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [
            json.loads(x) for x in controlplane.log.read_text().splitlines() if x.startswith("{")
        ]
        hits = [
            e
            for e in lines
            if e.get("event") == "http_request" and e.get("request_id") == "rid-check-1"
        ]
        if hits:
            assert hits[0]["status"] == 401 and "duration_ms" in hits[0]
            return
        time.sleep(0.05)
    raise AssertionError("no access line for request rid-check-1")
