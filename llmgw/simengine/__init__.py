"""The simulator engine behind `llmgw simengine`: a real engine process without a GPU.

Pure core (no I/O, unit-tested directly):

    tokenizer.py      reversible constructed vocabulary (~75.6k ids)
    chat_template.py  the fixed ChatML template /tokenize and chat completions share
    sampling.py       deterministic output per (seed, prompt), stop strings and ids
    block_pool.py     paged KV cache: ref counts, prefix-hash index, LRU eviction, queued events
    scheduler.py      Megatron-style continuous batching over the block pool
    control.py        pause / unpause / suspend / resume transitions
    timing.py         the step cost model
    lora_runtime.py   registered and held LoRA adapters, their ids, LRU eviction
    kv_transfer.py    --kv-transfer-config, and which blocks a producer stores or a consumer loads

Thin shell: engine.py (asyncio loop in modelled time), publisher.py (ZMQ PUB +
replay ROUTER), http_app.py + generation.py + openai_wire.py + api_models.py
(HTTP), api_routes.py (the Responses, Messages, embeddings, rerank and score
routes, over the pure responses.py, messages.py, embeddings.py and scores.py),
lora_routes.py (vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter),
limits.py (body caps, over llmgw.http.bodies), metrics.py (vLLM metric names),
kv_storage.py (the shared-storage connector's block files), config.py, server.py
(uvicorn).

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
- One process serves every API family (vLLM serves generation or pooling per
  process); `/v1/embeddings` are feature-hashed pseudo-embeddings that bypass
  the scheduler, and `/v1/rerank` and `/v1/score` score each pair as a
  cross-encoder would, from those pseudo-embeddings (scores.py says how). The Responses store is on (VLLM_ENABLE_RESPONSES_API_STORE=1)
  and bounded. On the Responses and Messages routes the output limit is a
  ceiling over a natural length, clamped to the context as vLLM 0.32 clamps it.
- LoRA adapters have no weights. A runtime load checks only that its path
  exists; vLLM also reads adapter_config.json and the weights there, and it
  downloads a Hugging Face repo id, which the simulator treats as missing.
  `--lora-modules` paths are not checked at all, so tests can name adapters
  that exist nowhere. A load, and a step that reads an evicted adapter back,
  take --lora-load-time-s. The held cache never evicts an adapter that a
  running request uses (vLLM does, and reads it back next step). A load that
  finds every slot in use is refused 503. --max-loras is not applied to
  batches. lora_runtime.py has the details.
- KV transfer (prefill/decode disaggregation) speaks vLLM's shared-storage
  connector (`ExampleConnector`): a producer writes one file per full prompt
  block, named by its hash, and a consumer loads the prompt's stored blocks
  as cached at --kv-load-ms-per-token. The blocks hold no tensors, and
  `shared_storage_path` is required (vLLM defaults it to /tmp), so unrelated
  runs never share blocks.
"""

from __future__ import annotations

__all__: list[str] = []
