"""The KV-delta endpoint's core: decode, throttle full copies, hand over to ``ShardViews``.

Runs on the event loop with no I/O: the node was authenticated from memory and the body read
under its cap by the HTTP shell (``router.py``); ``placed`` is ``PlacedCache``'s map, never a
query (docs/architecture.md §5: no database traffic on the KV path).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from llmgw.controlplane.agentapi.metrics import AgentApiMetrics
from llmgw.controlplane.agentapi.placed import PlacedCache
from llmgw.errors import MalformedJsonError, TooManyRequestsError
from llmgw.kv.shard_views import ShardViews
from llmgw.protocol.kvstream import KvStreamError, decode_kv_request, encode_kv_response
from llmgw.ratelimit import TokenBucket

__all__ = ["KvHandler"]


class KvHandler:
    def __init__(
        self,
        intake: ShardViews,
        placed: PlacedCache,
        limiter: TokenBucket,
        metrics: AgentApiMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.intake = intake
        self.placed = placed
        self.limiter = limiter
        self.metrics = metrics
        self.clock = clock

    def handle(self, node_id: uuid.UUID, body: bytes) -> bytes:
        """The response body for one request from ``node_id``; raises a refusal of ``llmgw.errors``."""
        try:
            request = decode_kv_request(body)
        except KvStreamError as exc:
            self.metrics.kv_requests.labels("invalid").inc()
            raise MalformedJsonError(exc.message) from None
        if request.reset:
            wait_s = self.limiter.admit(self.clock())
            if wait_s is not None:
                self.metrics.kv_requests.labels("throttled").inc()
                raise TooManyRequestsError(
                    "too many full KV copies at once (after a control plane restart every "
                    "agent sends one); retry after the Retry-After seconds",
                    retry_after_s=wait_s,
                )
        result = self.intake.apply(str(node_id), request, self.placed.placed_map())
        self.metrics.kv_requests.labels(result).inc()
        return encode_kv_response(result)
