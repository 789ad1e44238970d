"""The gateway tokenizes as the engine does: ``HfTokenizer`` from a model's tokenizer files
gives exactly the ids a real simulator process's /tokenize gives (it renders and encodes with
the same files), for chats and completions across the options a template sees; the gateway
routes on them without asking a replica; a planted template that differs from the engine's is
caught by the verification and the model falls back to the replica's /tokenize.
"""

from __future__ import annotations

import array
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from llmgw.config import GatewaySettings
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.router import HashParams
from llmgw.kv.hf_tokenizer import HfTokenizer, TokenizerFiles
from llmgw.kv.shard_views import PlacedShard, ShardViews
from llmgw.protocol.kvstream import KvDeltaRequest
from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir
from tests.gateway.gateway_testkit import SIM_KEY, Key, Served, serve_gateway
from tests.simengine.sim_process import HASH_SEED, SimProcess, start_sim, stop_sim
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

KEYS = {"s1": Key("k1", "plain")}
PLAIN = {"Authorization": "Bearer llmgw_k1_s1"}
LORA = ("demo-sql", "/models/demo-sql-lora")  # config/demo.yaml's adapter
PARAMS = HashParams(seed=HASH_SEED, block_size=16, extra_key_format="tagged")

# A template exercising what HF templates use: the special tokens' strings, tools through
# tojson, a chat_template_kwargs switch, loop controls, raise_exception, whitespace control.
RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def _rich_dir(root: Path) -> Path:
    out = root / "rich-model"
    out.mkdir()
    shutil.copy(tiny_model_dir() / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((tiny_model_dir() / "tokenizer_config.json").read_text())
    config["chat_template"] = "ignored: chat_template.jinja wins"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(RICH_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[SimProcess, Path]]]:
    tmp = tmp_path_factory.mktemp("sims")
    # Two replicas of the tiny model that load the demo's adapter, one of another template.
    dirs = {"tiny": tiny_model_dir(), "tiny2": tiny_model_dir(), "rich": _rich_dir(tmp)}
    started: dict[str, tuple[SimProcess, Path]] = {}
    try:
        for name, directory in dirs.items():
            sim = start_sim(
                tmp,
                *("--served-model-name", "m", "--time-scale", "0.05"),
                *("--tokenizer", str(directory)),
                *(("--lora-modules", f"{LORA[0]}={LORA[1]}") if name != "rich" else ()),
                env={"SIMENGINE_API_KEY": SIM_KEY},
            )
            started[name] = (sim, directory)
        yield started
    finally:
        for sim, _ in started.values():
            stop_sim(sim)


def _remote(sim: SimProcess, body: Mapping[str, Any]) -> list[int]:
    r = httpx.post(
        f"{sim.base_url}/tokenize",
        json={"model": "m", **body},
        headers={"Authorization": f"Bearer {SIM_KEY}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


SYSTEM = "You are a helpful assistant. " * 40
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello! How are you today?"}]},
    {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy? ünïcödé ✓"},
        ]
    },
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "user", "content": "Write a haiku."},
            {"role": "assistant", "content": "The quick brown fox"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "text", "text": "part two"},
                ],
            }
        ],
    },
    {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
    {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}],
    },
    {
        "messages": [{"role": "user", "content": "Think less."}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
]
PROMPTS: list[dict[str, Any]] = [
    {"prompt": "The engine starts, loads the weights, and listens on its port."},
    {"prompt": "<|im_start|>user\n" + SYSTEM + "<|im_end|>\n", "add_special_tokens": False},
    {"prompt": SYSTEM + " 1 2 3 4 5 100 1000", "add_special_tokens": True},
]


@pytest.mark.e2e
def test_local_tokens_equal_the_engines_tokenize(
    sims: dict[str, tuple[SimProcess, Path]],
) -> None:
    tokenizers = {}
    for name, (sim, directory) in sims.items():
        if name == "tiny2":
            continue
        local = tokenizers[name] = HfTokenizer(read_tokenizer_dir(directory))
        assert local.segment_cached, name
        for body in CHATS:
            remote = _remote(sim, body)
            # Twice: the second encode reads the shared pieces from the segment cache.
            for _ in range(2):
                assert local.request_ids(body, chat=True) == remote, (name, body)
        for body in PROMPTS:
            assert local.request_ids(body, chat=False) == _remote(sim, body), (name, body)
    rich = tokenizers["rich"]
    assert rich.segment_cache.hits > 0
    # The template's own choices show: tools rendered through tojson, the kwarg honoured.
    text = rich.render_chat(CHATS[6]["messages"], tools=CHATS[6]["tools"])
    assert '"name": "weather"' in text and text.startswith("<|bos|>")
    assert rich.render_chat(CHATS[7]["messages"], chat_template_kwargs={"enable_thinking": False}
                            ).endswith("<think></think>")  # fmt: skip


def test_the_segment_cache_never_changes_the_ids() -> None:
    files = read_tokenizer_dir(tiny_model_dir())
    tok = HfTokenizer(files)
    raw = tok._tok  # the library itself, encoding whole texts
    texts = [
        "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\nq<|im_end|>\n",
        "  leading spaces " + SYSTEM + "<|im_end|><|im_end|>trailing\n\n",
        "<|bos|>" + "x" * 300 + "<|eos|>" + "y" * 10,
    ]
    for text in texts:
        for special in (False, True):
            want = raw.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special) == want
            assert tok.encode(text, add_special_tokens=special) == want


def _sims_table(sim: SimProcess) -> RouteTable:
    ep = Endpoint("r0", "s0", sim.base_url, SIM_KEY, "m", PARAMS, {})
    return RouteTable({"m": ModelRoute("m", "m", None, (ep,))}, 1.0)


class _Files:
    def __init__(self, files: Mapping[str, TokenizerFiles]) -> None:
        self.files = files


def _sample(gw: Served, name: str, labels: dict[str, str]) -> float:
    registry: CollectorRegistry = gw.registry
    return registry.get_sample_value(name, labels) or 0.0


def _chat(gw: Served, i: int) -> None:
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={
            "model": "m",
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"},
            ],
        },
        headers=PLAIN,
        timeout=10,
    )
    assert r.status_code == 200, r.text


def _wait(predicate: Any, what: str, deadline_s: float = 10.0) -> None:
    wait_for(predicate, timeout_s=deadline_s, what=what, interval_s=0.02)


def _intake() -> ShardViews:
    return ShardViews()


@pytest.mark.e2e
def test_local_tokenizing_routes_and_a_planted_template_falls_back(
    sims: dict[str, tuple[SimProcess, Path]],
) -> None:
    sim, directory = sims["tiny"]
    settings = GatewaySettings(tokenize_timeout_s=2.0, tokenizer_verify_first=2)
    same = _Files({"m": read_tokenizer_dir(directory)})
    mode = "llmgw_prefix_tokenizer_mode"
    with serve_gateway(_sims_table(sim), KEYS, settings=settings, intake=_intake(),
                       tokenizer_files=same) as gw:  # fmt: skip
        _wait(lambda: gw.gateway.tokens.local.mode("m") == "local", "the files load")
        for i in range(4):
            _chat(gw, i)
        local = "llmgw_prefix_tokenize_local_seconds_count"
        assert _sample(gw, local, {"model": "m"}) == 4
        # Verified (the first two) and found equal: no call to /tokenize on the request path.
        assert _sample(gw, "llmgw_prefix_tokenize_seconds_count", {"model": "m"}) == 0
        assert _sample(gw, "llmgw_prefix_tokenizer_mismatches_total", {"model": "m"}) == 0
        gw.gateway.tokens.report_modes()
        assert _sample(gw, mode, {"model": "m", "mode": "local"}) == 1
        assert _sample(gw, mode, {"model": "m", "mode": "remote"}) == 0

    # Files whose template differs from the engine's: a system line it never renders.
    planted = dict(read_tokenizer_dir(directory).files)
    config = json.loads(planted["tokenizer_config.json"])
    config["chat_template"] = "<|im_start|>system\nplanted<|im_end|>\n" + config["chat_template"]
    planted["tokenizer_config.json"] = json.dumps(config).encode()
    wrong = _Files({"m": TokenizerFiles(planted)})
    with serve_gateway(_sims_table(sim), KEYS, settings=settings, intake=_intake(),
                       tokenizer_files=wrong) as gw:  # fmt: skip
        _wait(lambda: gw.gateway.tokens.local.mode("m") == "local", "the files load")
        _chat(gw, 0)
        _wait(lambda: gw.gateway.tokens.local.mode("m") == "remote", "the mismatch is caught")
        assert _sample(gw, "llmgw_prefix_tokenizer_mismatches_total", {"model": "m"}) == 1
        assert "differ" in (gw.gateway.tokens.local.disabled_reason("m") or "")
        assert _sample(gw, mode, {"model": "m", "mode": "remote"}) == 1
        assert _sample(gw, mode, {"model": "m", "mode": "local"}) == 0
        # From now on the replica's /tokenize tokenizes for routing.
        _chat(gw, 1)
        assert _sample(gw, "llmgw_prefix_tokenize_seconds_count", {"model": "m"}) == 1
        assert _sample(gw, "llmgw_prefix_tokenize_local_seconds_count", {"model": "m"}) == 1


@pytest.mark.e2e
def test_a_route_whose_profile_says_none_is_never_tokenized_here(
    sims: dict[str, tuple[SimProcess, Path]],
) -> None:
    """``tokenizer: none`` on a profile reaches the gateway on the route (store.routes): with
    the model's files loaded, its prompts go to a replica's /tokenize from the next request on,
    and back to local tokens when the route no longer says so."""
    sim, directory = sims["tiny"]
    settings = GatewaySettings(tokenize_timeout_s=2.0, tokenizer_verify_first=0)
    files = _Files({"m": read_tokenizer_dir(directory)})
    table = _sims_table(sim)
    route = table.routes["m"]
    off = RouteTable({"m": ModelRoute("m", "m", None, route.endpoints, tokenizer_none=True)}, 2.0)
    mode, local, remote = (
        "llmgw_prefix_tokenizer_mode",
        "llmgw_prefix_tokenize_local_seconds_count",
        "llmgw_prefix_tokenize_seconds_count",
    )
    with serve_gateway(table, KEYS, settings=settings, intake=_intake(),
                       tokenizer_files=files) as gw:  # fmt: skip
        _wait(lambda: gw.gateway.tokens.local.mode("m") == "local", "the files load")
        _chat(gw, 0)
        assert (_sample(gw, local, {"model": "m"}), _sample(gw, remote, {"model": "m"})) == (1, 0)
        # The profile is edited to none: the route table the gateway reads next says so.
        gw.gateway.routes.table = off  # type: ignore[misc]
        for i in (1, 2):
            _chat(gw, i)
        assert (_sample(gw, local, {"model": "m"}), _sample(gw, remote, {"model": "m"})) == (1, 2)
        gw.gateway.tokens.report_modes()
        assert _sample(gw, mode, {"model": "m", "mode": "remote"}) == 1
        assert _sample(gw, "llmgw_prefix_tokenizer_profile_none", {"model": "m"}) == 1
        # The files stayed loaded: the edit back tokenizes locally again at once.
        assert gw.gateway.tokens.local.mode("m") == "local"
        gw.gateway.routes.table = table  # type: ignore[misc]
        _chat(gw, 3)
        assert (_sample(gw, local, {"model": "m"}), _sample(gw, remote, {"model": "m"})) == (2, 2)
        gw.gateway.tokens.report_modes()
        assert _sample(gw, mode, {"model": "m", "mode": "local"}) == 1
        assert _sample(gw, "llmgw_prefix_tokenizer_profile_none", {"model": "m"}) == 0


def _sync_index(intake: ShardViews, sims: list[SimProcess], versions: dict[str, int]) -> None:
    """Each engine's blocks, as the agent's full copy of its mirror would carry them."""
    placed = {f"s{i}": PlacedShard("node", "m", 16) for i in range(len(sims))}
    for i, sim in enumerate(sims):
        shard = f"s{i}"
        held = httpx.get(f"{sim.base_url}/debug/kv_blocks", timeout=5).json()
        versions[shard] = versions.get(shard, 0) + 1
        request = KvDeltaRequest(
            shard_id=shard,
            base_version=0,
            new_version=versions[shard],
            reset=True,
            block_size=16,
            added={"GPU": array.array("Q", [b["hash"] for b in held["blocks"]])},
        )
        assert intake.apply("node", request, placed) == "ack"


def _lora_chat(url: str, model: str, question: str, headers: Mapping[str, str]) -> int:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": "You write SQL. " + SYSTEM},
                {"role": "user", "content": question},
            ],
        },
        headers=dict(headers),
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.e2e
def test_lora_prompts_hash_with_their_adapter(sims: dict[str, tuple[SimProcess, Path]]) -> None:
    replicas = [sims["tiny"][0], sims["tiny2"][0]]
    eps = tuple(
        Endpoint(f"r{i}", f"s{i}", s.base_url, SIM_KEY, "m", PARAMS, {LORA[0]: LORA[1]})
        for i, s in enumerate(replicas)
    )
    table = RouteTable(
        {"m": ModelRoute("m", "m", None, eps), LORA[0]: ModelRoute(LORA[0], "m", LORA, eps)},
        1.0,
    )
    intake = ShardViews()
    versions: dict[str, int] = {}
    # The adapter's prompt is computed on the second replica only, behind the gateway's back.
    engine = {"Authorization": f"Bearer {SIM_KEY}"}
    _lora_chat(replicas[1].base_url, LORA[0], "warm up", engine)
    _sync_index(intake, replicas, versions)
    files = _Files({"m": read_tokenizer_dir(tiny_model_dir())})
    settings = GatewaySettings(tokenize_timeout_s=2.0, affinity_tokens=0)
    with serve_gateway(table, KEYS, settings=settings, intake=intake, tokenizer_files=files) as gw:
        _wait(lambda: gw.gateway.tokens.local.mode("m") == "local", "the files load")
        hits = {"model": LORA[0], "method": "precise", "outcome": "hit"}
        for i in range(3):
            # Repeated adapter requests sharing the prompt: precise hits where it is held.
            assert _lora_chat(gw.url, LORA[0], f"query {i}", PLAIN) >= 16 * 10
        assert _sample(gw, "llmgw_prefix_decisions_total", hits) == 3
        assert _sample(gw, "llmgw_prefix_tokenize_local_seconds_count", {"model": LORA[0]}) == 3
        # The base model's request for the same text hashes without the adapter: it scores
        # none of the adapter's blocks (a miss), and the engine confirms nothing is cached.
        misses = {"model": "m", "method": "precise", "outcome": "miss"}
        assert _lora_chat(gw.url, "m", "query 0", PLAIN) == 0
        assert _sample(gw, "llmgw_prefix_decisions_total", misses) == 1
