"""The gateway processes' metrics, read into a control plane that has no public listener.

With the OpenAI API in `llmgw gateway` processes, the gateway's metrics (routing decisions,
tokenizer modes, queues) live in those processes' registries, served on their private
listeners. What reads "the control plane's /metrics" (``llmgw status``, the console's routing
charts, a single scrape target on a one-machine deployment) would see none of them, so a
control plane started without its public listener registers a ``GatewayMetrics`` collector:
every ``period_s`` it reads ``/metrics`` of every live gateway instance (rows whose id has
``GATEWAY_ID_PREFIX``, from the agent API's instance list) and its ``collect`` yields them,
merged across workers. A fleet's Prometheus may scrape each gateway directly instead.

Merging several workers' samples of one name and labels: counters, histograms and most
gauges (in flight, queued) are summed, being per worker; the ``_created`` timestamps take the
earliest; the gauges that state one shared fact (a model's tokenizer mode, the size of the KV
index every worker holds a copy of) take the largest. The agent API's own families
(``llmgw_agent_*``, which the gateway's private listener counts too) are left out: the control
plane's registry has its own.

What it must not do: read anything on ``collect`` (it runs on the event loop inside a
``/metrics`` request), or fail a scrape of the control plane because a gateway is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmgw.controlplane.instances import is_gateway
from llmgw.gateway.metrics import GatewayMetrics as OwnMetrics
from llmgw.http.bodies import BadContentLength, BodyTooLarge, declared_length, read_capped
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.protocol.sync import ControlPlaneInstance

__all__ = ["GatewayMetrics", "merge"]

log = get_logger("llmgw.serve")

# One fact each worker states alike: the largest, not the sum, says it.
_MAX_FAMILIES = frozenset(
    {
        "llmgw_prefix_tokenizer_mode",
        "llmgw_prefix_tokenizer_profile_none",
        "llmgw_prefix_index_entries",
        "llmgw_prefix_approx_entries",
    }
)
_OWN_PREFIXES = ("llmgw_agent_",)
_TIMEOUT_S = 1.0
# One gateway's exposition: a few hundred KiB with many models and replicas. Read under a cap,
# as every other scrape is, so a wrong URL in an instance row cannot fill this process.
_MAX_BYTES = 4 << 20


def _described(registry: CollectorRegistry) -> tuple[Metric, ...]:
    return tuple(Metric(m.name, m.documentation, m.type) for m in registry.collect())


def _gateway_families() -> tuple[Metric, ...]:
    """What a gateway's registry holds (``gateway.metrics``), as families without samples."""
    registry = CollectorRegistry(auto_describe=True)
    OwnMetrics.create(registry)
    return _described(registry)


def merge(texts: Iterable[str]) -> list[Metric]:
    """The families of several expositions, merged as the module says."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name.startswith(_OWN_PREFIXES):
                continue
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            into = values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = into.get(key)
                if old is None:
                    into[key] = s.value
                elif s.name.endswith("_created"):
                    into[key] = min(old, s.value)
                elif merged.name in _MAX_FAMILIES:
                    into[key] = max(old, s.value)
                else:
                    into[key] = old + s.value
    for name, metric in families.items():
        for (sample, labels), value in values[name].items():
            metric.add_sample(sample, dict(labels), value)
    return list(families.values())


class GatewayMetrics(Collector):
    """Reads the live gateway instances' metrics every ``period_s``; yields the last read."""

    def __init__(
        self,
        instances: Callable[[], Sequence[ControlPlaneInstance]],
        *,
        period_s: float = 1.0,
    ) -> None:
        self._instances = instances
        self._families: list[Metric] = []
        self._client: httpx.AsyncClient | None = None
        self._reader = Periodic(
            self.read, name="gateway-metrics", interval_s=period_s, run_at_start=True
        )
        self._unreachable: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        # The families a gateway defines, by name and type, read from its own definitions
        # (registering must not read a gateway): a restricted read of this registry by name,
        # such as the console sampler's, finds this collector only through them.
        return _gateway_families()

    def collect(self) -> Iterable[Metric]:
        return self._families

    async def read(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT_S)
        gateways = [inst for inst in self._instances() if is_gateway(inst.id)]
        # All at once: one gateway that hangs costs the read its timeout, not each one after it.
        texts = await asyncio.gather(*(self._read_one(self._client, inst) for inst in gateways))
        try:
            self._families = merge(t for t in texts if t is not None)
        except ValueError as exc:  # not an exposition: keep what was read last
            log.warning("gateway_metrics_unparsable", error=repr(exc))

    async def _read_one(self, client: httpx.AsyncClient, inst: ControlPlaneInstance) -> str | None:
        try:
            async with client.stream("GET", f"{inst.internal_url}/metrics") as r:
                r.raise_for_status()
                declared = declared_length(r.headers.get("content-length"))
                body = await read_capped(r.aiter_bytes(), _MAX_BYTES, declared)
        except (httpx.HTTPError, BodyTooLarge, BadContentLength) as exc:
            # A gateway stopping, or restarting: its row ages out within seconds.
            if inst.id not in self._unreachable:
                log.info("gateway_metrics_unreadable", instance=inst.id, error=repr(exc))
                self._unreachable.add(inst.id)
            return None
        self._unreachable.discard(inst.id)
        return body.decode("utf-8", errors="replace")

    def start(self) -> None:
        self._reader.start()

    async def stop(self) -> None:
        await self._reader.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
