"""The API families beyond chat through `llmgw up`'s demo (simulator engines), with the official
clients unchanged: OpenAI's Responses (stored, chained by `previous_response_id`, retrieved,
streamed) and embeddings through `openai`, Anthropic's Messages (streamed and not) and
count_tokens through `anthropic`; each request accounted in the usage rows, each route counted
under its `api` label. The README's example of them runs as written, with this run's URL and key
in place of its placeholders."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import pg_dir
from tests.support.waiting import WaitTimeout, wait_for
from tests.up.up_harness import Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def up_info() -> Iterator[tuple[Up, dict[str, Any]]]:
    with pg_dir() as root:
        up = Up.new(root).start()
        try:
            yield up, up.wait_up()
        finally:
            assert up.stop() == 0, up.logs()


def _usage(info: dict[str, Any]) -> dict[str, int]:
    """The usage rows the gateways accounted, summed (the admin API's total per key, model)."""
    r = httpx.get(
        f"{info['admin_url']}/admin/v1/usage",
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=10,
    )
    r.raise_for_status()
    total: dict[str, int] = {}
    for row in r.json()["items"]:
        for k in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens"):
            total[k] = total.get(k, 0) + int(row[k])
    return total


def _api_counts(info: dict[str, Any]) -> dict[str, float]:
    text = httpx.get(f"{info['admin_url']}/metrics", timeout=10).text
    return {
        s.labels["api"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "llmgw_gateway_api_requests"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("status") == "200"
    }


def test_the_official_clients_speak_every_family(up_info: tuple[Up, dict[str, Any]]) -> None:
    _, info = up_info
    key = info["api_key"]
    before = _usage(info)
    client = openai.OpenAI(base_url=info["base_url"], api_key=key)

    first = client.responses.create(
        model="demo", input="Tell me about fleets of machines serving models.", max_output_tokens=8
    )
    assert first.output_text and first.usage is not None and first.usage.output_tokens >= 1
    assert first.id.startswith("resp_")
    second = client.responses.create(
        model="demo", input="And more?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.usage is not None
    # The follow-up ran where the first is stored: its conversation is the first's, cached.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(second.id).id == second.id
    with client.responses.stream(model="demo", input="Stream, please", max_output_tokens=6) as s:
        events = [e.type for e in s]
        final = s.get_final_response()
    assert "response.output_text.delta" in events and events[-1] == "response.completed"
    assert final.usage is not None and final.usage.output_tokens >= 1
    assert client.responses.retrieve(final.id).id == final.id

    vectors = client.embeddings.create(model="demo", input=["a fleet", "of machines"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) > 0
    assert vectors.usage.prompt_tokens > 0

    base = info["base_url"].removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key=key)  # sent as x-api-key
    message = claude.messages.create(
        model="demo",
        max_tokens=8,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert message.content[0].type == "text" and message.usage.output_tokens >= 1
    with claude.messages.stream(
        model="demo", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final_message = stream.get_final_message()
    assert text and final_message.usage.output_tokens >= 1
    counted = claude.messages.count_tokens(
        model="demo", messages=[{"role": "user", "content": "Hi"}]
    )
    assert counted.input_tokens > 0
    # The bearer spelling works on the same routes.
    bearer = anthropic.Anthropic(base_url=base, auth_token=key)
    assert bearer.messages.create(
        model="demo", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    ).content

    # Every create is accounted: 3 responses, 1 embeddings, 3 messages, 1 count (retrieves
    # generate nothing and are not).
    def accounted() -> dict[str, int] | None:
        now = _usage(info)
        return now if now.get("requests", 0) - before.get("requests", 0) >= 8 else None

    after = wait_for(accounted, timeout_s=20, what="the usage rows")
    assert after["completion_tokens"] > before.get("completion_tokens", 0)
    assert after["cached_tokens"] > before.get("cached_tokens", 0)
    # Counted when each answer ends (a stream's at its last event), and read from the gateway
    # process's metrics as the control plane last copied them: wait for all of them.
    want = {"responses": 5, "messages": 3, "embeddings": 1, "count_tokens": 1}
    seen: dict[str, float] = {}

    def counted() -> bool:
        seen.update(_api_counts(info))
        return all(seen.get(api, 0) >= n for api, n in want.items())

    try:
        wait_for(counted, timeout_s=20, what="the api-labelled request counts")
    except WaitTimeout:
        raise AssertionError(f"api-labelled counts {seen}, wanted at least {want}") from None


def test_a_background_response_is_charged_its_reservation(
    up_info: tuple[Up, dict[str, Any]],
) -> None:
    # The engine answers `background: true` at once (queued) and generates afterwards: no
    # answer the gateway relays carries its usage, so the key pays what it reserved. A key of
    # its own: the other tests' usage rows are flushed on their own schedule.
    _, info = up_info
    admin = {"Authorization": f"Bearer {info['admin_token']}"}
    made = httpx.post(
        f"{info['admin_url']}/admin/v1/keys", headers=admin, json={"name": "background"}, timeout=10
    )
    assert made.status_code == 201, made.text
    client = openai.OpenAI(base_url=info["base_url"], api_key=made.json()["key"])

    def answered() -> Any:
        try:
            return client.responses.create(
                model="demo", input="Work on this later.", background=True, max_output_tokens=40
            )
        except openai.AuthenticationError:
            return None  # the gateways learn of a new key within a second

    queued = wait_for(answered, timeout_s=10, what="the new key to be known")
    assert queued.status in ("queued", "in_progress") and queued.usage is None

    def charged() -> dict[str, int] | None:
        r = httpx.get(
            f"{info['admin_url']}/admin/v1/usage",
            params={"key": "background"},
            headers=admin,
            timeout=10,
        )
        r.raise_for_status()
        rows = r.json()["items"]
        return rows[0] if rows and rows[0]["requests"] >= 1 else None

    row = wait_for(charged, timeout_s=20, what="the background response's usage row")
    assert (row["requests"], row["completion_tokens"]) == (1, 40), row
    assert row["prompt_tokens"] > 0
    # It ran on its replica all the same, retrieved there through its signed id.
    done = wait_for(
        lambda: (
            (r := client.responses.retrieve(queued.id)).status not in ("queued", "in_progress")
            and r
        ),
        timeout_s=30,
        what="the background response to finish",
    )
    assert done.id == queued.id and done.output_text


def test_errors_keep_each_familys_shape(up_info: tuple[Up, dict[str, Any]]) -> None:
    _, info = up_info
    base = info["base_url"].removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key="llmgw_wrong_key")
    with pytest.raises(anthropic.AuthenticationError):
        claude.messages.create(
            model="demo", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    good = anthropic.Anthropic(base_url=base, api_key=info["api_key"])
    with pytest.raises(anthropic.NotFoundError) as missing:
        good.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert "nope" in str(missing.value)
    # max_tokens is Anthropic's required field: a 400 naming it, in Anthropic's shape.
    r = httpx.post(
        f"{base}/v1/messages",
        headers={"x-api-key": info["api_key"]},
        json={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "max_tokens" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_made_up")


def test_the_readme_example_of_the_other_apis_runs(up_info: tuple[Up, dict[str, Any]]) -> None:
    _, info = up_info
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    block = next(b for b in blocks if "responses.create" in b)
    assert "http://127.0.0.1:8080/v1" in block and "llmgw_..." in block
    block = block.replace("http://127.0.0.1:8080/v1", info["base_url"]).replace(
        "llmgw_...", info["api_key"]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "OPENAI_"))}
    ran = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert any(ln.startswith("responses:") for ln in lines), ran.stdout
    assert any(re.match(r"embeddings: \d+ dimensions", ln) for ln in lines), ran.stdout
    assert any(ln.startswith("messages:") for ln in lines), ran.stdout


def test_rerank_and_score_through_the_gateway_are_accounted(
    up_info: tuple[Up, dict[str, Any]],
) -> None:
    _, info = up_info
    headers = {"Authorization": f"Bearer {info['api_key']}"}
    query = "What is the capital of France?"
    documents = [
        "Bananas are yellow fruit rich in potassium.",
        "The capital of France is Paris.",
        "Turtles are slow reptiles with shells.",
    ]
    before = _usage(info)

    ranked = httpx.post(
        f"{info['base_url']}/rerank",
        headers=headers,
        json={"model": "demo", "query": query, "documents": documents, "top_n": 2},
        timeout=30,
    )
    assert ranked.status_code == 200, ranked.text
    rerank = ranked.json()
    assert rerank["id"].startswith("score-") and rerank["model"] == "demo"
    results = rerank["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["document"]["text"] == documents[1]
    assert results[0]["relevance_score"] > results[1]["relevance_score"]
    assert rerank["usage"]["prompt_tokens"] == rerank["usage"]["total_tokens"] > 0

    scored = httpx.post(
        f"{info['base_url']}/score",
        headers=headers,
        json={"model": "demo", "text_1": query, "text_2": documents},
        timeout=30,
    )
    assert scored.status_code == 200, scored.text
    score = scored.json()
    assert score["object"] == "list" and [d["index"] for d in score["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in score["data"])
    values = [d["score"] for d in score["data"]]
    assert max(range(3), key=values.__getitem__) == 1
    # The same pairs, so the same tokens: rerank's top_n cuts the results, not the work.
    assert score["usage"]["prompt_tokens"] == rerank["usage"]["prompt_tokens"]
    prompt_tokens = rerank["usage"]["prompt_tokens"] + score["usage"]["prompt_tokens"]

    def accounted() -> dict[str, int] | None:
        now = _usage(info)
        grew = now.get("requests", 0) - before.get("requests", 0) >= 2 and (
            now.get("prompt_tokens", 0) - before.get("prompt_tokens", 0) >= prompt_tokens
        )
        return now if grew else None

    wait_for(accounted, timeout_s=20, what="the rerank and score usage rows")
    counts = wait_for(
        lambda: (c := _api_counts(info)).get("rerank", 0) >= 1 and c.get("score", 0) >= 1 and c,
        timeout_s=20,
        what="the rerank and score api-labelled request counts",
    )
    assert counts["rerank"] >= 1 and counts["score"] >= 1
