"""The node agent's KV-event relay: each engine's KV events, mirrored on the node and streamed
to every control plane instance (docs/architecture.md §5).

- relay.py: ``KvRelay``, the agent-facing shell (watch/unwatch, one asyncio stream per
  control plane instance);
- ingest.py: the one thread that owns the ZMQ sockets, feeding each engine's mirror;
- feed.py: one watched engine's state (its SUB socket, mirror, block size);
- replay.py: gaps and forward fills from an engine's replay socket, on the ingest thread;
- state.py: the mirrors persisted in the agent's state dir;
- stream.py: what to send an instance about a shard, and when (pure);
- metrics.py: the relay's Prometheus metrics.

It must NOT import the control plane. Submodules are imported by name; this package
re-exports nothing.
"""
