"""The CLI's one table renderer: its layout, and no control character from the admin API
reaching the terminal raw (an OSC sequence retitling it, a newline printing a fake row)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from llmgw.cli import app
from llmgw.commands.get import render_table as render_kind
from llmgw.commands.status import render
from llmgw.commands.tables import render_table, visible

OSC = "\x1b]0;evil\x07"  # would set the terminal's title
EVIL_NODE = f"gpu-{OSC}1"
FAKE_ROW = "a\nb   approved   default"  # a newline would print a row of its own


def _raw(text: str) -> list[str]:
    """The control characters in `text` other than the newlines between lines."""
    return [ch for ch in text if ch != "\n" and (ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F)]


def test_columns_are_three_spaces_apart_left_aligned_absent_values_a_dash() -> None:
    out = render_table(["NAME", "N", "NOTE"], [["a", 1, None], ["longer", 22, ""]])
    assert out.splitlines() == ["NAME     N    NOTE", "a        1    -", "longer   22   -"]
    assert render_table(["NAME"], []) == "NAME"


def test_a_long_row_is_never_wrapped_or_cut() -> None:
    long = "x" * 300
    out = render_table(["A", "B"], [[long, "end"]])
    assert out.splitlines()[1] == f"{long}   end"


def test_markup_is_printed_as_text() -> None:
    assert render_table(["A"], [["[bold]x[/bold]"]]).splitlines()[1] == "[bold]x[/bold]"


def test_control_characters_are_escaped_visibly() -> None:
    assert visible(OSC) == "\\x1b]0;evil\\x07"
    assert visible("a\nb\tc\r\x00\x7f\x9b") == "a\\nb\\tc\\r\\x00\\x7f\\x9b"
    assert visible("\u202eabc\u2028") == "\\u202eabc\\u2028"
    assert visible("gpu-1 …ü中") == "gpu-1 …ü中"  # printable text stays as it is
    out = render_table(["NAME", "X"], [[OSC, "a\nb"]])
    assert _raw(out) == [] and len(out.splitlines()) == 2
    assert out.splitlines()[1] == "\\x1b]0;evil\\x07   a\\nb"


def _node(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "approval_state": "approved",
        "pool": "default",
        "num_gpus": 4,
        "free_gpus": 3,
        "num_shards": 1,
        "cordoned": False,
        "draining": False,
        "last_sync_at": None,
    }


def test_get_nodes_and_status_escape_a_hostile_node_name() -> None:
    table = render_kind("nodes", [_node(EVIL_NODE), _node(FAKE_ROW)])
    assert _raw(table) == [] and len(table.splitlines()) == 3
    assert not any(line.startswith("b ") for line in table.splitlines())
    assert "gpu-\\x1b]0;evil\\x071" in table and "a\\nb" in table

    data = {
        "nodes": [
            {
                "name": n,
                "approval": "approved",
                "pool": "default",
                "gpus": 4,
                "free_gpus": 3,
                "shards": 1,
                "cordoned": False,
                "draining": False,
                "last_sync_at": None,
            }
            for n in (EVIL_NODE, FAKE_ROW)
        ],
        "deployments": [],
        "shards": [],
        "prefix_routing": {f"m{OSC}": {"decisions": 1, "hits": 1, "precise": 1, "hit_rate": 1.0}},
    }
    screen = render(data)
    assert _raw(screen) == []
    assert "gpu-\\x1b]0;evil\\x071" in screen and "m\\x1b]0;evil\\x07" in screen
    assert not any(line.startswith("b ") for line in screen.splitlines())


class _FakeAdmin(BaseHTTPRequestHandler):
    """An admin API whose nodes (and a shard placed on one) carry hostile names."""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        replica = {
            "id": "r1",
            "deployment": "d",
            "state": "active",
            "ready": False,
            "stale": False,
            "shards": [{"id": "s1", "node": EVIL_NODE, "rank": 0, "observed_state": "failed",
                        "reason": f"exit 1{OSC}\nfake", "gpus": [{"index": 0}]}],
        }  # fmt: skip
        body: Any = {
            "/admin/v1/nodes": {"items": [_node(EVIL_NODE), _node(FAKE_ROW)]},
            "/admin/v1/deployments": {"items": []},
            "/admin/v1/replicas": {"items": [replica]},
            "/admin/v1/demand": {"items": []},
        }.get(path)
        data = json.dumps(
            body if body is not None else {"error": {"message": "no such route"}}
        ).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def admin_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeAdmin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("command", [["get", "nodes"], ["status"]])
def test_the_commands_never_print_a_control_character(admin_url: str, command: list[str]) -> None:
    r = CliRunner().invoke(app, [*command, "--url", admin_url, "--admin-token", "t"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert _raw(r.stdout) == [], r.stdout
    assert "gpu-\\x1b]0;evil\\x071" in r.stdout
    assert not any(line.startswith(("b ", "fake")) for line in r.stdout.splitlines())
