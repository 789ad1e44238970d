"""The simulator engine behind `llmgw simengine`: a real engine process without a GPU.

Pure core (no I/O, unit-tested directly):

    tokenizer.py      reversible constructed vocabulary (~75.6k ids)
    chat_template.py  the fixed ChatML template /tokenize and chat completions share
    sampling.py       deterministic output per (seed, prompt), stop strings and ids
    block_pool.py     paged KV cache: ref counts, prefix-hash index, LRU eviction, queued events
    scheduler.py      Megatron-style continuous batching over the block pool
    control.py        pause / unpause / suspend / resume transitions
    timing.py         the step cost model

Thin shell: engine.py (asyncio loop in modelled time), publisher.py (ZMQ PUB +
replay ROUTER), http_app.py + generation.py + openai_wire.py + api_models.py
(HTTP), limits.py (body caps, over llmgw.http.bodies), metrics.py (vLLM metric
names), config.py, server.py (uvicorn).

Where the simulator deliberately differs from vLLM or Megatron, and why:

- With `max_tokens` a request emits exactly that many tokens unless a stop
  string or stop token id matches (as with vLLM's ignore_eos): benchmarks
  need predictable lengths. Without it (chat), a deterministic "natural"
  length of 16-256 tokens is drawn (a simulated EOS), within vLLM's limit
  of max_model_len - prompt.
- A control signal Megatron would drop silently (e.g. suspend while running)
  is answered 409 naming the allowed source state: over HTTP a silent drop
  would let an operator believe the cache was freed.
- Suspend uses Megatron's *recompute* mode: the whole cache is freed
  (AllBlocksCleared) and active requests requeue to be re-prefilled after
  resume, so "suspend frees the cache" is observable in the events.
- When every request holding blocks is paused and nothing can move, the
  youngest is preempted (blocks freed, requeued at the front), as Megatron
  evicts paused requests past its paused-buffer budget; otherwise requests
  that each fit alone could deadlock together.
- Request bodies are capped (--max-body-bytes, 413) and nest at most 64
  levels (400), and the sampling fields vLLM validates are validated (400,
  naming the field) though only temperature and seed affect the output. vLLM
  caps neither bodies nor nesting; the simulator runs in every test and must
  not be the thing one request can freeze.
- /health answers 503 while "loading" (vLLM refuses connections instead) and
  200 `{"state": ...}` afterwards, paused and suspended included.
"""

from __future__ import annotations

__all__: list[str] = []
