"""The router's pure core: decide(), precise_shares() over a real PrefixIndex, the approximate
tree, and build_table(). Table tests for the rules, hypothesis for the invariants."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.engines import ANY_ENGINE_LOAD_METRICS, LoadMetrics, engine_load_metrics
from llmgw.gateway.routes import DeclaredRow, RouteRow, build_table
from llmgw.gateway.routing.approx import ApproxTree, chunk_hashes
from llmgw.gateway.routing.router import (
    Candidate,
    Decision,
    HashParams,
    Inputs,
    Rule,
    decide,
    home_key,
    hot_share,
    precise_shares,
    token_home_key,
)
from llmgw.kv import PrefixIndex, block_hashes, hash64

A, B, C = (Candidate("ra", "sa", 0), Candidate("rb", "sb", 0), Candidate("rc", "sc", 0))


def _load(c: Candidate, load: int, work: float = 0.0) -> Candidate:
    return Candidate(c.replica, c.shard, load, work)


# --- decide: the rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cands", "precise", "approx", "want", "method", "outcome"),
    [
        # The longest held prefix wins.
        ([A, B, C], {"ra": 0.2, "rb": 0.9, "rc": 0.0}, None, "rb", "precise", "hit"),
        # Nobody holds anything: least-loaded, counted as a miss.
        ([_load(A, 3), B, _load(C, 1)], {"ra": 0, "rb": 0, "rc": 0}, None, "rb", "precise", "miss"),
        # The holder is overloaded (load 9 > 0 + slack 4): passed over, counted.
        (
            [_load(A, 9), B, C],
            {"ra": 1.0, "rb": 0.0, "rc": 0.0},
            None,
            "rb",
            "precise",
            "overloaded",
        ),
        # Within the slack a hit still wins over a lighter replica.
        ([_load(A, 4), B, C], {"ra": 1.0, "rb": 0.0, "rc": 0.0}, None, "ra", "precise", "hit"),
        # A second-best holder within slack is taken when the best is overloaded.
        (
            [_load(A, 9), _load(B, 1), C],
            {"ra": 1.0, "rb": 0.5, "rc": 0},
            None,
            "rb",
            "precise",
            "overloaded",
        ),
        # Partial views (missing from `precise`) are scored by the approximate tier.
        ([A, B], {"ra": 0.1}, {"ra": 0.0, "rb": 0.8}, "rb", "precise", "hit"),
        # No precise view at all (index not warm): counted as approximate, never as precise.
        ([A, B], None, {"ra": 0.0, "rb": 0.5}, "rb", "approximate", "hit"),
        ([A, B], {}, {"ra": 0.7, "rb": 0.5}, "ra", "approximate", "hit"),
        # Precise finds no holder (the prefix is still in its first prefill somewhere): the
        # tree of what this gateway sent where decides, counted as approximate.
        ([A, B, C], {"ra": 0, "rb": 0, "rc": 0}, {"rc": 0.6}, "rc", "approximate", "hit"),
        # Neither tier: least-loaded.
        ([_load(A, 2), B], None, None, "rb", "least_loaded", "none"),
    ],
)
def test_decide_rules(
    cands: list[Candidate],
    precise: Mapping[str, float] | None,
    approx: Mapping[str, float] | None,
    want: str,
    method: str,
    outcome: str,
) -> None:
    d = decide(cands, Rule("auto", load_slack=4), Inputs(precise=precise, approximate=approx))
    assert (d.replica, d.method, d.outcome) == (want, method, outcome)


@pytest.mark.parametrize(
    ("works", "shares", "want", "outcome"),
    [
        # A holder 1,000 tokens of prefill behind still beats recomputing 1,000 x 1.5.
        ((1000, 0, 0), (1.0, 0.0, 0.0), "ra", "hit"),
        # 2,000 behind is worse than recomputing elsewhere: passed over, counted.
        ((2000, 0, 50), (1.0, 0.0, 0.0), "rb", "overloaded"),
        # A half-holder with nothing queued beats a full holder with a long queue.
        ((1400, 0, 300), (1.0, 0.5, 0.0), "rb", "overloaded"),
        # A miss goes where the least prefill is queued, whatever the request counts say.
        ((900, 100, 400), (0.0, 0.0, 0.0), "rb", "miss"),
    ],
)
def test_a_prefix_is_worth_the_wait_only_while_waiting_is_cheaper_than_recomputing(
    works: tuple[float, float, float], shares: tuple[float, ...], want: str, outcome: str
) -> None:
    # Request counts point the other way (rb is the busiest): work decides among eligible.
    cands = [_load(A, 0, works[0]), _load(B, 3, works[1]), _load(C, 1, works[2])]
    precise = dict(zip(("ra", "rb", "rc"), shares, strict=True))
    d = decide(
        cands, Rule("auto", recompute_weight=1.5), Inputs(precise=precise, prompt_tokens=1000)
    )
    assert (d.replica, d.outcome) == (want, outcome)


def test_only_what_the_index_shows_is_worth_waiting_past_the_break_even() -> None:
    # ra holds the prompt, 1,200 tokens of prefill behind; rb is idle. At weight 3 the index's
    # word keeps it on ra; the tree's claim (maybe long evicted) is weighed at 1: rb.
    cands = [_load(A, 0, 1200.0), _load(B, 0, 0.0)]
    shares = {"ra": 1.0, "rb": 0.0}
    rule = Rule("auto", recompute_weight=3.0)
    assert decide(cands, rule, Inputs(precise=shares, prompt_tokens=1000)).replica == "ra"
    d = decide(cands, rule, Inputs(approximate=shares, prompt_tokens=1000))
    assert (d.replica, d.method, d.outcome) == ("rb", "approximate", "overloaded")


def test_forced_policies() -> None:
    cands = [C, A, B]
    rr = [decide(cands, Rule("round_robin"), Inputs(rotation=i)).replica for i in range(6)]
    assert rr == ["ra", "rb", "rc", "ra", "rb", "rc"]
    assert decide(cands, Rule("random"), Inputs(pick=0.99)).replica == "rb"
    assert decide(cands, Rule("random"), Inputs(pick=0.0)).replica == "rc"
    d = decide([_load(A, 5), B, C], Rule("least_loaded"), Inputs(precise={"ra": 1.0}))
    assert d.method == "least_loaded" and d.replica in ("rb", "rc")


def test_session_affinity_breaks_ties_and_is_stable() -> None:
    cands = [A, B, C]
    chosen = {
        decide(cands, Rule("auto"), Inputs(approximate={}, session="s1", rotation=i)).replica
        for i in range(10)
    }
    assert len(chosen) == 1
    # Without a session, ties rotate so equal replicas share the work.
    spread = {decide(cands, Rule("least_loaded"), Inputs(rotation=i)).replica for i in range(3)}
    assert spread == {"ra", "rb", "rc"}
    # Affinity never beats a longer prefix.
    d = decide(cands, Rule("auto"), Inputs(precise={"ra": 0.0, "rb": 0.0, "rc": 0.5}, session="s1"))
    assert d.replica == "rc"


def test_a_session_goes_home_within_the_affinity_tokens() -> None:
    # Every replica holds the system prompt; the chat's own part is nowhere yet. Two gateways
    # deciding it agree on its home: the choice hangs on the prompt, not on a gateway's
    # rotation or state.
    cands = [A, _load(B, 1, 300.0), _load(C, 2, 600.0)]
    chunks = chunk_hashes("a system prompt for every chat " * 20 + "chat 7 asks " * 30, 64)
    common = dict.fromkeys(("ra", "rb", "rc"), 9 / len(chunks))
    home = home_key(chunks, common.values())

    def route(rotation: int, tokens: float, cs: list[Candidate] = cands) -> str:
        return decide(
            cs,
            Rule("auto", recompute_weight=1.0, affinity_tokens=tokens),
            Inputs(precise=common, prompt_tokens=1000, home=home, rotation=rotation),
        ).replica

    homes = {route(i, 1000.0) for i in range(5)}
    assert len(homes) == 1
    at = homes.pop()
    # Home is the same whatever the loads, as long as it is within reach of the cheapest.
    even = [A, B, C]
    assert route(0, 1000.0, even) == at
    # Past the affinity tokens the cheapest wins; at 0 (off) too.
    far = [Candidate(c.replica, c.shard, 0, 2000.0 if c.replica == at else 0.0) for c in even]
    assert route(0, 1000.0, far) != at
    assert route(0, 0.0) == "ra"
    # Many chats spread over the replicas (rendezvous hashing), not all to one.
    spread = set()
    for g in range(30):
        text = chunk_hashes("a system prompt for every chat " * 20 + f"chat {g} asks " * 30, 64)
        spread.add(
            decide(
                even,
                Rule("auto", affinity_tokens=1000.0),
                Inputs(precise=common, prompt_tokens=1000, home=home_key(text, common.values())),
            ).replica
        )
    assert spread == {"ra", "rb", "rc"}
    # A prompt nobody holds has no cache to share: its prefill goes where it starts soonest.
    miss = dict.fromkeys(("ra", "rb", "rc"), 0.0)
    for g in range(10):
        d = decide(
            cands,
            Rule("auto", affinity_tokens=1000.0),
            Inputs(
                precise=miss,
                prompt_tokens=1000,
                home=home_key(chunk_hashes(f"group {g} " * 40, 64), miss.values()),
            ),
        )
        assert (d.replica, d.outcome) == ("ra", "miss")


def test_chats_sharing_a_system_prompt_spread_over_homes_and_stay_there() -> None:
    # One replica holds the system prompt every chat starts with. The cheapest alone sends
    # every new chat there (recomputing it elsewhere costs more than waiting for nothing),
    # and its cache evicts them; with homes, a first turn goes to its chat's home for that
    # little recompute, and later turns follow it there.
    system = "you are a helpful assistant " * 25  # 700 characters: 10 whole chunks
    held_system = len(chunk_hashes(system, 64))

    def turn(chunks: list[int], shares: dict[str, float], tokens: int) -> Decision:
        return decide(
            [A, B, C],
            Rule("auto", recompute_weight=3.0, affinity_tokens=768.0),
            Inputs(precise=shares, prompt_tokens=tokens, home=home_key(chunks, shares.values())),
        )

    firsts = {}
    for chat in range(24):
        text = system + f"chat {chat} asks: " + "tell me about the sea " * 60
        chunks = chunk_hashes(text, 64)
        shares = {"ra": held_system / len(chunks), "rb": 0.0, "rc": 0.0}
        d = turn(chunks, shares, 600)
        firsts[chat] = d.replica
        # The next turn: its home holds the first turn, the others the system prompt.
        later = chunk_hashes(text + " and then more " * 40, 64)
        held = {
            r: (len(chunks) if r == d.replica else held_system) / len(later)
            for r in ("ra", "rb", "rc")
        }
        again = turn(later, held, 900)
        assert (again.replica, again.outcome) == (d.replica, "hit")
        # The chat has one name: the first turn's and the next's homes are one.
        assert home_key(chunks, shares.values()) == home_key(later, held.values())
    assert set(firsts.values()) == {"ra", "rb", "rc"}
    without = {
        decide(
            [A, B, C],
            Rule("auto", recompute_weight=3.0),
            Inputs(precise={"ra": 0.3, "rb": 0.0, "rc": 0.0}, prompt_tokens=600),
        ).replica
        for chat in range(24)
    }
    assert without == {"ra"}


def test_a_long_system_prompt_every_chat_opens_with_spreads_to_every_replica() -> None:
    # An 800-token system prompt, held by the replica that computed it first: at recompute
    # weight 3 recomputing it elsewhere costs 2,400 tokens, past any home, so without fork
    # counts every chat lands there. Counting where prompts part (the tree, as the gateway
    # records every decision) shows the prefix carries every chat's traffic: sessions take it
    # to their homes until every replica holds it, and later turns stay home.
    system = "you are a careful assistant who answers in full " * 64  # ~3,100 chars
    replicas = ("ra", "rb", "rc")

    def run(count_forks: bool) -> tuple[dict[int, str], set[str]]:
        tree = ApproxTree(fork_half_life_s=60.0 if count_forks else None)
        holds: dict[str, set[int]] = {r: set() for r in replicas}  # an ideal cache per replica
        homes: dict[int, str] = {}
        for step in range(60):
            chat, turn = step % 20, step // 20
            text = system + "".join(
                f"chat {chat} turn {t}: tell me more. " * 8 for t in range(turn + 1)
            )
            chunks = tree.chunks(text)
            shares = {}
            for r in replicas:
                depth = 0
                while depth < len(chunks) and chunks[depth] in holds[r]:
                    depth += 1
                shares[r] = depth / len(chunks)
            hot = hot_share(tree.fork_shares("m", chunks, now=step), len(chunks), shares.values())
            d = decide(
                [A, B, C],
                Rule("auto", recompute_weight=3.0, affinity_tokens=768.0),
                Inputs(
                    precise=shares,
                    prompt_tokens=len(text) // 4,
                    hot=hot,
                    home=home_key(chunks, shares.values()),
                ),
            )
            tree.record("m", chunks, d.replica, now=step)
            holds[d.replica].update(chunks)
            # Past the first prompts (too few to count forks on) a chat stays where it began;
            # the first chats, piled on the system prompt's holder, move home once.
            if turn == 0 or (turn == 1 and step < 20 + 8):
                homes[chat] = d.replica
            else:
                assert d.replica == homes[chat], "a later turn left its history"
        system_chunk = tree.chunks(system)[-1]
        return homes, {r for r in replicas if system_chunk in holds[r]}

    homes, holders = run(count_forks=True)
    assert holders == set(replicas)
    assert set(homes.values()) == set(replicas)
    assert max(list(homes.values()).count(r) for r in replicas) <= 12
    homes, holders = run(count_forks=False)
    assert set(homes.values()) == {"ra"} and holders == {"ra"}


@pytest.mark.parametrize(
    ("forks", "shares", "want"),
    [
        # Every prompt parts after chunk 4 (index 3): held by 1 of 3, it deserves 3 copies.
        ([0, 0, 0, 1.0, 0, 0], [0.6, 0.0, 0.0], 4 / 8),
        # Held by all three: enough copies.
        ([0, 0, 0, 1.0, 0, 0], [0.6, 0.9, 0.7], 0.0),
        # A third of the traffic (a group's prompt): one copy carries it.
        ([0, 0, 0, 0.33, 0, 0], [0.6, 0.0, 0.0], 0.0),
        # Half of it over three replicas, held by one: a second copy is worth having.
        ([0, 0, 0, 0.5, 0, 0], [0.6, 0.0, 0.0], 4 / 8),
        # ... held by two: not a third.
        ([0, 0, 0, 0.5, 0, 0], [0.6, 0.5, 0.0], 0.0),
        # The deepest fork that deserves more copies wins over a shallower one.
        ([0, 0.9, 0, 0, 0.8, 0], [0.7, 0.3, 0.3], 5 / 8),
        # No fork counts yet (too few prompts): nothing is hot.
        ([], [0.6, 0.0, 0.0], 0.0),
    ],
)
def test_hot_share_is_the_deepest_prefix_with_fewer_copies_than_its_traffic_deserves(
    forks: list[float], shares: list[float], want: float
) -> None:
    assert hot_share(forks, 8, shares) == pytest.approx(want)


def test_a_hot_prefix_costs_nothing_to_recompute_and_a_cold_one_keeps_its_weight() -> None:
    held = {"ra": 0.8, "rb": 0.0, "rc": 0.0}
    rule = Rule("auto")
    cold = Inputs(precise=held, prompt_tokens=1000)
    busy = [_load(A, 1, work=1500.0), B, C]
    # Cold: waiting 1,500 tokens beats recomputing 800 at weight 3.
    assert decide(busy, rule, cold).replica == "ra"
    # Hot: recomputing the shared 80% counts as nothing; the rest (200 at weight 3) is the
    # same everywhere, so the least work wins, and the outcome still says a holder was passed.
    d = decide(busy, rule, replace(cold, hot=0.8))
    assert d.replica in ("rb", "rc") and d.outcome == "overloaded"
    # The part past the hot prefix keeps its weight: a holder of the whole prompt with 500
    # tokens queued stays (elsewhere the last 200 cost 600).
    whole = {"ra": 1.0, "rb": 0.8, "rc": 0.0}
    queued = [_load(A, 1, work=500.0), B, C]
    assert decide(queued, rule, replace(cold, precise=whole, hot=0.8)).replica == "ra"


def test_token_home_keys_name_leading_blocks_like_the_chunks_do() -> None:
    tokens = list(range(100))
    other = tokens[:64] + [7] * 36  # shares 4 blocks with it

    def name(ids: list[int], held_blocks: int) -> str | None:
        units = (len(ids) - 1) // 16  # 99 // 16 = 6: the last token is always computed
        return token_home_key(ids, 16, [held_blocks / units] if held_blocks else [0.0])

    # Named by the block past the shared prefix (with one of margin): within the 4 shared
    # blocks the names agree, past them they differ.
    assert name(tokens, 2) == name(other, 2)  # block 3
    assert name(tokens, 3) != name(other, 3)  # block 4
    # A prompt nobody holds is named by its first block; 6 scorable blocks, not 7.
    assert name(tokens, 0) == name(other, 0) == name(tokens[:32], 0)
    assert name(tokens, 4) == name(tokens, 6) != name(tokens, 3)  # the last block, at most
    # 32 tokens: the 2nd block never hits, so the first one names it whatever is held.
    assert name(tokens[:32], 1) == name(tokens, 0)


def test_a_home_never_costs_more_than_the_affinity_tokens() -> None:
    # A holder of 1,800 of a 1,832-token prompt keeps it: going home would recompute it.
    chunks = chunk_hashes("a long group system prompt and then a question " * 40, 64)
    for held in ("ra", "rb", "rc"):
        shares = {r: (0.98 if r == held else 0.0) for r in ("ra", "rb", "rc")}
        d = decide(
            [A, B, C],
            Rule("auto", recompute_weight=3.0, affinity_tokens=768.0),
            Inputs(precise=shares, prompt_tokens=1832, home=home_key(chunks, shares.values())),
        )
        assert (d.replica, d.outcome) == (held, "hit")


def test_decide_needs_a_candidate() -> None:
    with pytest.raises(ValueError, match="at least one"):
        decide([], Rule("auto"))


@st.composite
def _world(draw: st.DrawFn) -> tuple[list[Candidate], dict[str, float], int, int]:
    n = draw(st.integers(1, 6))
    cands = [
        Candidate(f"r{i}", f"s{i}", draw(st.integers(0, 20)), draw(st.sampled_from([0, 500, 2e3])))
        for i in range(n)
    ]
    shares = {c.replica: draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])) for c in cands}
    return cands, shares, draw(st.integers(0, 6)), draw(st.sampled_from([0, 100, 1000, 4000]))


@given(_world(), st.integers(0, 100), st.sampled_from([0.0, 300.0, 3000.0]), st.integers(0, 4))
def test_a_request_goes_where_it_waits_and_recomputes_least(
    world: tuple[list[Candidate], dict[str, float], int, int],
    rotation: int,
    affinity: float,
    n_chunks: int,
) -> None:
    cands, shares, slack, tokens = world
    d = decide(
        cands,
        Rule("auto", load_slack=slack, recompute_weight=1.5, affinity_tokens=affinity),
        Inputs(
            precise=shares,
            prompt_tokens=tokens,
            home=home_key(list(range(7, 7 + n_chunks)), shares.values()),
            rotation=rotation,
        ),
    )
    low = min(c.load for c in cands)
    eligible = [c for c in cands if c.load <= low + slack]
    chosen = next(c for c in cands if c.replica == d.replica)
    assert chosen in eligible  # never a replica past the request guard

    def cost(c: Candidate) -> float:
        return c.work + (1 - shares[c.replica]) * tokens * 1.5

    cheapest = min(cost(c) for c in eligible)
    # Within the affinity slack of the cheapest (exactly the cheapest without a home to go
    # to), and holding as much as the best of the cheapest.
    homing = affinity > 0 and n_chunks > 0
    assert cost(chosen) <= cheapest + (affinity if homing else 0.0)
    if not homing:  # ... and of the cheapest, one holding the most
        assert shares[d.replica] == max(shares[c.replica] for c in eligible if cost(c) == cheapest)
    assert d.outcome in ("hit", "miss", "overloaded")
    assert (d.outcome == "miss") == (max(shares.values()) == 0)
    assert (d.outcome == "hit") == (0 < shares[d.replica] == max(shares.values()))


# --- precise_shares over the real index ----------------------------------------------------------

P = HashParams(seed="4242", block_size=4, extra_key_format="tagged")


def _stored(tokens: list[int], *, salt: str | None = None, params: HashParams = P) -> list[int]:
    return [
        hash64(d)
        for d in block_hashes(
            tokens,
            params.block_size,
            seed=params.seed,
            cache_salt=salt,
            extra_key_format=params.extra_key_format,
        )
    ]


def test_precise_shares_count_leading_blocks_and_skip_partial_views() -> None:
    index = PrefixIndex()
    prompt = list(range(1, 18))  # 17 tokens: 4 scorable blocks of 4
    held = _stored(prompt)
    index.apply_snapshot("m", "sa", {"gpu": held[:4]})
    index.apply_snapshot("m", "sb", {"gpu": held[:2]})
    index.apply_snapshot("m", "sc", {"gpu": held[1:4]})  # no first block: matches nothing
    index.apply_snapshot("m", "sd", {"gpu": held}, partial=True)
    d = Candidate("rd", "sd", 0)
    shares = precise_shares(
        index, "m", prompt, {P: [A, B, C, d]}, complete=lambda s: s != "sx", cache_salt=None
    )
    assert shares == {"ra": 1.0, "rb": 0.5, "rc": 0.0}  # rd: partial -> the approximate tier


def test_precise_never_scores_the_last_block_of_an_exact_multiple() -> None:
    index = PrefixIndex()
    prompt = list(range(1, 17))  # 16 tokens = 4 full blocks; vLLM can hit at most 3
    held = _stored(prompt)
    index.apply_snapshot("m", "sa", {"gpu": held[:3]})
    shares = precise_shares(index, "m", prompt, {P: [A]}, complete=lambda s: True, cache_salt=None)
    assert shares == {"ra": 1.0}


def test_precise_hashes_with_the_salt_so_tenants_never_match() -> None:
    index = PrefixIndex()
    prompt = list(range(100, 140))
    index.apply_snapshot("m", "sa", {"gpu": _stored(prompt, salt="tenant-a")})
    a = precise_shares(index, "m", prompt, {P: [A]}, complete=lambda s: True, cache_salt="tenant-a")
    b = precise_shares(index, "m", prompt, {P: [A]}, complete=lambda s: True, cache_salt="tenant-b")
    none = precise_shares(index, "m", prompt, {P: [A]}, complete=lambda s: True, cache_salt=None)
    assert a == {"ra": 1.0} and b == {"ra": 0.0} and none == {"ra": 0.0}


def test_precise_hashes_once_per_parameter_group() -> None:
    other = HashParams(seed="7", block_size=4, extra_key_format="legacy")
    index = PrefixIndex()
    prompt = list(range(1, 30))
    index.apply_snapshot("m", "sa", {"gpu": _stored(prompt)})
    index.apply_snapshot("m", "sb", {"gpu": _stored(prompt, params=other)})
    shares = precise_shares(
        index, "m", prompt, {P: [A], other: [B]}, complete=lambda s: True, cache_salt=None
    )
    assert shares == {"ra": 1.0, "rb": 1.0}
    # Scored with the wrong group's parameters, nothing matches.
    crossed = precise_shares(
        index, "m", prompt, {other: [A], P: [B]}, complete=lambda s: True, cache_salt=None
    )
    assert crossed == {"ra": 0.0, "rb": 0.0}


# --- the approximate tree ----------------------------------------------------------------------


def test_approx_tree_scores_leading_chunks_per_model_and_replica() -> None:
    tree = ApproxTree(chunk_chars=4, max_entries=1000, ttl_s=10)
    system = "abcdefghijklmnop"  # 4 chunks
    tree.record("m", tree.chunks(system + "1234"), "ra", now=0)
    tree.record("m", tree.chunks(system[:8]), "rb", now=0)
    got = tree.score("m", tree.chunks(system + "zzzz"), ["ra", "rb", "rc"], now=1)
    assert got == {"ra": 0.8, "rb": 0.4, "rc": 0.0}
    assert tree.score("other", tree.chunks(system), ["ra"], now=1) == {"ra": 0.0}
    # Past the TTL a claim no longer scores.
    assert tree.score("m", tree.chunks(system), ["ra"], now=11) == {"ra": 0.0}


def test_a_forgotten_replicas_claims_before_the_restart_no_longer_score() -> None:
    tree = ApproxTree(chunk_chars=4, ttl_s=100)
    chunks = tree.chunks("abcdefghijklmnop")
    tree.record("m", chunks, "ra", now=1)
    tree.record("m", chunks, "rb", now=1)
    tree.forget("ra", now=5)  # its engine restarted at 5
    assert tree.score("m", chunks, ["ra", "rb"], now=6) == {"ra": 0.0, "rb": 1.0}
    tree.record("m", chunks[:2], "ra", now=7)  # sent to the new process
    assert tree.score("m", chunks, ["ra", "rb"], now=8) == {"ra": 0.5, "rb": 1.0}


def test_approx_tree_is_bounded_lru() -> None:
    tree = ApproxTree(chunk_chars=2, max_entries=1000, ttl_s=100)
    for i in range(5000):
        tree.record("m", tree.chunks(f"{i:08d}"), "ra", now=i)
    assert len(tree) == 1000
    # The newest survive, the oldest are gone.
    assert tree.score("m", tree.chunks(f"{4999:08d}"), ["ra"], now=5000) == {"ra": 1.0}
    assert tree.score("m", tree.chunks(f"{0:08d}"), ["ra"], now=5000)["ra"] < 1.0


def test_the_tree_counts_where_prompts_part() -> None:
    tree = ApproxTree(chunk_chars=4, ttl_s=100, fork_half_life_s=10.0)
    system = "abcdefghijklmnop"  # 4 chunks every prompt opens with
    chats = [system + f"{c:04d}" + "x" * 8 for c in range(4)]
    # Too few prompts for a share to mean anything.
    tree.record("m", tree.chunks(chats[0]), "ra", now=0)
    assert tree.fork_shares("m", tree.chunks(chats[0]), now=0) == []
    now = 0.0
    for turn in range(4):
        for c, text in enumerate(chats):  # chats interleave: each parts from the one before
            now += 0.01
            chats[c] = text + f"{turn}" * 4
            tree.record("m", tree.chunks(chats[c]), "ra", now=now)
    forks = tree.fork_shares("m", tree.chunks(chats[0]), now=now)
    # Every prompt but the first two (chat 0 twice in a row) parted right after the system
    # prompt, none inside it, and a chat's history never parts (each turn extends the last).
    assert forks[3] == pytest.approx(15 / 17, rel=0.01)
    assert forks[:3] == [0.0, 0.0, 0.0]
    assert all(f == 0.0 for f in forks[4:])
    # One chat's turns alone part nowhere.
    solo = ApproxTree(chunk_chars=4, ttl_s=100)
    text = system
    for turn in range(12):
        text += f"{turn:04d}"
        solo.record("m", solo.chunks(text), "ra", now=turn)
    assert not any(solo.fork_shares("m", solo.chunks(text), now=12))
    # Counts decay (half-life 10 s) like the prompt count they are shared by: the share
    # stays, and a model that has gone quiet for long says nothing.
    assert tree.fork_shares("m", tree.chunks(chats[0]), now=now + 10)[3] == pytest.approx(forks[3])
    assert tree.fork_shares("m", tree.chunks(chats[0]), now=now + 100) == []
    # A tree of claims only (the gateway's in-flight claims) counts nothing.
    claims = ApproxTree(chunk_chars=4, fork_half_life_s=None)
    for text in chats * 4:
        claims.record("m", claims.chunks(text), "ra", now=float("inf"))
    assert claims.fork_shares("m", claims.chunks(chats[0]), now=1.0) == []


@given(st.text(max_size=200), st.integers(1, 16))
def test_chunk_hashes_are_prefix_stable(text: str, size: int) -> None:
    whole = chunk_hashes(text + "tail" * 10, size)
    part = chunk_hashes(text, size)
    assert whole[: len(part)] == part


# --- the route table ---------------------------------------------------------------------------


def _row(replica: str, *, ready: bool = True, **profile: Any) -> RouteRow:
    base = {"name": "p", "engine": "sim", "model": "m", "served_model_name": ""}
    base.update(profile)
    return RouteRow(
        shard=f"s-{replica}",
        replica=replica,
        proxy_url=f"http://agent/shards/s-{replica}/",
        api_key="engine-secret-xyz",
        ready=ready,
        index_model="m",
        profile=base,
    )


def test_build_table_names_models_and_adapters() -> None:
    rows = [
        _row(
            "r1",
            adapters=[{"name": "sql", "path": "/a/sql"}],
            kv_events=True,
            kv_hash={"seed": "9", "block_size": 16, "extra_key_format": "tagged"},
        ),
        _row("r2"),
        _row("r3", ready=False),
        _row("r4", served_model_name="other", ready=False),
    ]
    table = build_table(rows, read_at=1.0)
    m = table.routes["m"]
    assert [e.replica for e in m.endpoints] == ["r1", "r2"]
    assert m.endpoints[0].url == "http://agent/shards/s-r1"
    assert m.endpoints[0].hash == HashParams("9", 16, "tagged")
    assert m.endpoints[1].hash is None
    sql = table.routes["sql"]
    assert (sql.base, sql.lora, [e.replica for e in sql.endpoints]) == (
        "m",
        ("sql", "/a/sql"),
        ["r1"],
    )
    # Deployed but nothing ready: known (503), not unknown (404).
    assert table.routes["other"].endpoints == ()
    assert "engine-secret-xyz" not in repr(m.endpoints[0])  # never in a log line


def test_build_table_a_model_name_wins_over_an_adapter_of_the_same_name() -> None:
    rows = [_row("r1", adapters=[{"name": "m2", "path": "/x"}]), _row("r2", served_model_name="m2")]
    table = build_table(rows, read_at=0)
    assert table.routes["m2"].lora is None
    assert [e.replica for e in table.routes["m2"].endpoints] == ["r2"]


def test_a_deployed_model_without_live_replicas_is_known_not_unknown() -> None:
    declared = [DeclaredRow("gone", (("gone-sql", "/a"),)), DeclaredRow("m")]
    table = build_table([_row("r1")], read_at=0, declared=declared)
    assert table.routes["gone"].endpoints == () and table.routes["gone-sql"].lora == (
        "gone-sql",
        "/a",
    )
    assert [e.replica for e in table.routes["m"].endpoints] == ["r1"]


def test_each_endpoint_carries_its_engines_load_metrics() -> None:
    # The gateway scrapes the names the replica's engine adapter reports its load under
    # (store.routes reads them from the launched profile's engine), never its own list.
    vllm, llama = engine_load_metrics("vllm"), engine_load_metrics("llamacpp")
    rows = [
        replace(_row("r1", engine="vllm"), load_metrics=vllm),
        replace(_row("r2", engine="llamacpp"), load_metrics=llama),
        _row("r3"),  # a row that says nothing: every engine's names
    ]
    eps = {ep.replica: ep for ep in build_table(rows, read_at=1.0).routes["m"].endpoints}
    assert eps["r1"].load_metrics.running == ("vllm:num_requests_running",)
    assert eps["r2"].load_metrics.waiting == ("llamacpp:requests_deferred",)
    assert eps["r3"].load_metrics == ANY_ENGINE_LOAD_METRICS
    assert set(vllm.running + llama.running) == set(ANY_ENGINE_LOAD_METRICS.running)
    # The simulator exports vLLM's names; an engine without load metrics has none to read.
    assert engine_load_metrics("sim") == vllm
    assert engine_load_metrics("llama.cpp") == llama
    assert engine_load_metrics("megatron") == LoadMetrics()
    assert engine_load_metrics("an-engine-of-another-release") == ANY_ENGINE_LOAD_METRICS
