"""Attack list cases (see tests/up/attacks/__init__.py): tokenizing (hardening findings 1, 2, 3
and 8).

- A node's credential uploads, for the model its shard runs, chat templates that were bombs
  (two nested range(15000) loops froze the control plane 7.5 s; 'x' * 4e9, tojson(indent=1e9)
  and strftime_now('%Y' * 2e8) ended in MemoryError), a tokenizer that panics on a run of
  "a"s and one that fails every unknown word: each is refused (422) naming why, before it is
  stored. Then a sane set is uploaded, so the gateway tokenizes the demo's prompts locally
  (in its worker processes) from here on.
- Huge rendered bodies (160,000 empty messages: 4.5M characters once rendered; a ~1 MB prompt;
  a chat rendered past the cap): each answered 400 naming the limit, or served; never a 5xx.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from llmgw.protocol.tokenizers import TOKENIZER_PATH
from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir

TINY = read_tokenizer_dir(tiny_model_dir())
BOMBS = {
    "two nested loops": (
        "{% for i in range(15000) %}{% for j in range(15000) %}x{% endfor %}{% endfor %}"
    ),
    "string times 4e9": "{{ 'x' * 4000000000 }}",
    "tojson indent 1e9": "{{ messages | tojson(indent=1000000000) }}",
    "strftime_now format 2e8": "{{ strftime_now('%Y' * 200000000) }}",
}


def node_upload(run: Any) -> Callable[[dict[str, bytes]], httpx.Response]:
    """Upload files as the demo's node does: its credential (the agent's identity.json in the
    run's data dir) and the id of a shard it runs."""
    data_dir = Path(run.info["data_dir"])
    for identity_path in sorted(data_dir.rglob("identity.json")):
        shards = identity_path.parent / "shards"
        names = sorted(p.name for p in shards.iterdir()) if shards.is_dir() else []
        if names:
            break
    else:
        raise AssertionError(f"no agent with a shard under {data_dir}")
    identity = json.loads(identity_path.read_text())
    credential = identity["node_credential"]
    shard = names[0]

    def upload(files: dict[str, bytes]) -> httpx.Response:
        body = {
            "shard_id": shard,
            "files": {n: base64.b64encode(b).decode() for n, b in files.items()},
        }
        return run.anonymous.post(
            TOKENIZER_PATH,
            json=body,
            headers={"Authorization": f"Bearer {credential}"},
            timeout=120,
        )

    return upload


def _with_template(template: str) -> dict[str, bytes]:
    config = json.loads(TINY.files["tokenizer_config.json"])
    config["chat_template"] = template
    return {**TINY.files, "tokenizer_config.json": json.dumps(config).encode()}


def _with_tokenizer(**changes: Any) -> dict[str, bytes]:
    raw = json.loads(TINY.files["tokenizer.json"])
    raw.update(changes)
    return {**TINY.files, "tokenizer.json": json.dumps(raw).encode()}


def _uploaded_bombs_are_refused(run: Any) -> None:
    upload = node_upload(run)
    for name, template in BOMBS.items():
        r = run.expect(f"uploaded template: {name}", upload(_with_template(template)), 422)
        assert "refused" in r.text and (
            "steps" in r.text or "characters" in r.text or "over" in r.text
        ), r.text
    # A WordLevel model without its unk token: it loads, then fails every unknown word.
    wordlevel = _with_tokenizer(
        added_tokens=[],
        pre_tokenizer={"type": "Whitespace"},
        post_processor=None,
        decoder=None,
        model={"type": "WordLevel", "vocab": {"a": 0, "hello": 1}, "unk_token": "[UNK]"},
    )
    r = run.expect("uploaded WordLevel without its unk token", upload(wordlevel), 422)
    assert "UNK" in r.text, r.text
    # The healthz on the internal listener answered throughout (the checks ran elsewhere).
    run.expect("healthz after the uploads", run.anonymous.get("/healthz"), 200)
    # A sane set is stored: from here on the gateway tokenizes the demo locally.
    r = run.expect("uploaded the tiny tokenizer", upload(dict(TINY.files)), 200)
    assert r.json()["model"] == "demo", r.text


def _huge_rendered_bodies(run: Any) -> None:
    bodies = {
        "160,000 empty messages": (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": ""}] * 160_000},
        ),
        "~1 MB prompt": ("/v1/completions", {"model": "demo", "prompt": "word " * 200_000}),
        "~1 MB chat": (
            "/v1/chat/completions",
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "Lorem ipsum dolor sit amet. " * 36_000}],
            },
        ),
        "1.2 MB prompt": ("/v1/completions", {"model": "demo", "prompt": "x" * 1_200_000}),
    }
    for what, (path, body) in bodies.items():
        r = run.gateway.post(path, json={**body, "max_tokens": 4}, timeout=120)
        run.seen.append((what, r.status_code))
        run.http_answers += 1
        assert r.status_code in (200, 400), (what, r.status_code, r.text[:300])
        if r.status_code == 400:
            message = r.json()["error"]["message"]
            assert "characters" in message or "tokens" in message, (what, message)
    run.chat_ok("chat after the huge rendered bodies")


ATTACKS: list[Callable[[Any], None]] = [_uploaded_bombs_are_refused, _huge_rendered_bodies]
