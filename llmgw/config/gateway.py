"""The ``[gateway]`` section: the public OpenAI listener, routing, retries and the upstreams.

What it must not do: read the environment or a file (loading.py does).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmgw.config.section import Section

__all__ = ["GatewaySettings"]


class GatewaySettings(Section):
    host: str = Field(default="127.0.0.1", description="Address of the public OpenAI endpoint.")
    port: int = Field(default=8080, ge=0, le=65535)
    max_connections: int = Field(
        default=10_000,
        ge=16,
        le=1_000_000,
        description="Open connections of the public listener at most (default 10,000), lowered "
        "at start to what the descriptor limit allows beside the database and upstream pools. "
        "At the cap a new connection evicts the oldest one idle or still sending its headers; "
        "when every connection is inside a request, it is closed as soon as accepted.",
    )
    max_header_bytes: int = Field(
        default=64 << 10,
        ge=4 << 10,
        le=16 << 20,
        description="Largest request line plus headers read (default 64 KiB); a larger head "
        "is answered 431 and its connection closed, before it is parsed or authenticated.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Time a request's line and headers may take to arrive, from the "
        "connection's open or from their first byte (default 10 s); a slower client is "
        "answered 408 and closed. Idle keep-alive connections close after 5 s.",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        le=256 * 1024 * 1024,
        description="Largest OpenAI request body read, after the key is checked; a larger "
        "one is refused with 413 before it is buffered.",
    )
    routing_policy: Literal[
        "auto", "precise", "approximate", "least_loaded", "round_robin", "random"
    ] = Field(
        default="auto",
        description="How a replica is chosen. auto: precise prefix scoring where the index "
        "is warm, else the approximate tree, else least-loaded; the others force one policy "
        "(for benchmarks and for isolating a routing problem).",
    )
    routes_refresh_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="Period of the route table's re-read, a safety net: every write that "
        "changes a route NOTIFYs the gateways (database triggers), which re-read at once.",
    )
    load_scrape_s: float = Field(
        default=0.5, gt=0, le=30, description="Period of the engines' /metrics scrape."
    )
    load_slack: int = Field(
        default=8,
        ge=0,
        description="Prefix routing considers only replicas whose load (running + waiting "
        "requests, this gateway's in-flight included) exceeds the least-loaded candidate's "
        "by at most this much; among them it weighs queued prefill against recomputing.",
    )
    recompute_weight: float = Field(
        default=3.0,
        ge=1.0,
        le=10.0,
        description="Precise routing: how much a prompt token recomputed on a replica that "
        "does not hold it counts against a token of prefill queued on one that does. 1: each "
        "request goes where its first token comes soonest by the gateway's estimate; above "
        "1 keeps prefixes on their holders longer (a copy elsewhere evicts other prompts): "
        "a higher hit rate for about the same tail (bench/routing.py). Approximate decisions "
        "always weigh 1 (the tree's claims may be long evicted). A prefix that more of the "
        "traffic shares than its holders can carry (a system prompt every chat opens with) "
        "is not weighed at all: sessions copy it to their homes.",
    )
    affinity_tokens: float = Field(
        default=768.0,
        ge=0.0,
        le=1_000_000,
        description="Prefix routing: how much more cost (queued prefill plus weighted "
        "recompute, in prompt tokens) a request accepts to land on its session's home "
        "replica: the session is `user` or x-session-id, else the prompt's first KV block "
        "past the prefix it shares with others (a chat's first question); the home is "
        "picked by rendezvous hashing. Homes spread chats that share a system prompt over "
        "the replicas instead of piling them onto its first holder, and two gateways agree "
        "on them without talking. Not applied to prompts nobody holds. 0: off.",
    )
    tokenize_timeout_s: float = Field(
        default=0.02,
        gt=0,
        le=5,
        description="Budget of the /tokenize call of precise routing; past it the request "
        "is routed by the approximate tree.",
    )
    tokenize_concurrency: int = Field(
        default=64, ge=1, description="Tokenize calls in flight at most; more skip precise."
    )
    local_tokenize: bool = Field(
        default=True,
        description="Precise routing tokenizes prompts in the gateway, from each model's "
        "tokenizer files (shipped by the agents: the engine's, or the directory a profile's "
        "`tokenizer` names), verified on a sample against a replica's /tokenize; false: "
        "always the replica's /tokenize. A profile's `tokenizer: none` turns it off for its "
        "model alone.",
    )
    local_tokenize_workers: int = Field(
        default=2, ge=1, le=64, description="Worker processes tokenizing prompts locally."
    )
    local_tokenize_timeout_s: float = Field(
        default=0.05,
        gt=0,
        le=5,
        description="Budget of one local tokenizing; past it the request falls back to the "
        "replica's /tokenize, then to the approximate tree.",
    )
    local_tokenize_max_chars: int = Field(
        default=1_000_000,
        ge=1000,
        description="A prompt the gateway tokenizes locally whose text, or whose rendered "
        "chat template, is longer than this many characters is refused (400).",
    )
    tokenizer_verify_first: int = Field(
        default=8,
        ge=0,
        description="The first this many locally tokenized requests of a model's tokenizer "
        "files are also tokenized by a replica (off the request path) and compared.",
    )
    tokenizer_verify_every: int = Field(
        default=100,
        ge=1,
        description="After the first ones, one locally tokenized request in this many is "
        "verified; a difference turns local tokenizing off for those files.",
    )
    precise_min_blocks: int = Field(
        default=4,
        ge=1,
        description="Prompts estimated (by characters) shorter than this many KV blocks "
        "skip tokenizing: a short prompt's hit saves less than the call costs.",
    )
    approx_max_entries: int = Field(
        default=200_000,
        ge=1000,
        description="Chunk entries of the approximate prefix tree, all models together "
        "(LRU beyond it).",
    )
    approx_ttl_s: float = Field(
        default=600.0, gt=0, description="Age past which the approximate tree forgets a chunk."
    )
    default_max_tokens: int = Field(
        default=4096,
        ge=1,
        description="Completion tokens reserved against a key's limits when a chat request "
        "sets no max_tokens and the model's context length (from its replicas' /v1/models) "
        "is not known yet; once known, the context length less the prompt is reserved.",
    )
    retry_budget_ratio: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Retries allowed per request served (a token bucket), so a failing fleet "
        "is not hit twice as hard.",
    )
    eject_after_failures: int = Field(
        default=3, ge=1, description="Consecutive upstream failures that eject a replica."
    )
    eject_for_s: float = Field(default=10.0, gt=0, description="How long an ejection lasts.")
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_read_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest silence of an upstream before a 502."
    )
    upstream_pool_size: int = Field(
        default=512, ge=1, description="Open connections to engines at most (all replicas)."
    )
    queue_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="Longest a request waits in the gateway's queue for a replica with room "
        "(every replica at its admission limit); past it the request is shed with 503 and a "
        "Retry-After from the queue's drain rate.",
    )
    queue_max_requests: int = Field(
        default=10_000,
        ge=0,
        le=1_000_000,
        description="Requests one model's queue holds at most (default 10,000: a burst of "
        "that size waits instead of failing, at a few KiB of gateway memory each); more are "
        "shed with 503. 0: no queue, shed whatever finds no room.",
    )
    queue_max_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        le=64 * 1024**3,
        description="Request memory one model's queue holds at most (default 256 MiB): what "
        "each queued request's parsed body and prompt hold, walked (up to ~24x its raw bytes "
        "for a body of many small values), so a queue of large prompts cannot exhaust the "
        "gateway's memory; a request past it is refused with 429 and Retry-After.",
    )
    queue_max_bytes_total: int = Field(
        default=512 * 1024 * 1024,
        ge=0,
        le=256 * 1024**3,
        description="Request memory all models' queues hold together at most (default "
        "512 MiB), counted as for queue_max_bytes: without it N models could hold N times "
        "queue_max_bytes. A request past it is refused with 429 and Retry-After.",
    )
