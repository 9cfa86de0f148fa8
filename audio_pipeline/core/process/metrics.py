"""The front end's metrics registry with the engine core process's metrics in it, so that one
/metrics shows both processes. In ``launch_multiproc_server`` mode both processes write Prometheus's
multiprocess files (the core's process inherits PROMETHEUS_MULTIPROC_DIR) and /metrics aggregates
them; in the other modes each scrape asks the core for its metrics' text."""

from __future__ import annotations

import logging
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from audio_pipeline.core.metrics import MetricsRegistry

logger = logging.getLogger(__name__)


class CoreCollector:
    """A Prometheus collector of the metrics the core reports (none while it is down)."""

    def __init__(self, fetch: Callable[[], bytes]):
        self.fetch = fetch

    def collect(self):
        try:
            text = self.fetch().decode()
        except Exception as error:  # noqa: BLE001 - a scrape while the core restarts shows the front end's alone
            logger.warning("the engine core's metrics are unavailable: %s", error)
            return
        yield from text_string_to_metric_families(text)


def front_end_metrics(mode: str, fetch: Callable[[], bytes]) -> MetricsRegistry:
    metrics = MetricsRegistry(mode)
    if not metrics.multiprocess:
        metrics.registry.register(CoreCollector(fetch))
    return metrics
