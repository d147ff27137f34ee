"""The Prometheus exposition both halves share: one scrape of a registry, in the format Prometheus asks for.

Each process part (an agent, a control plane) builds its own
`CollectorRegistry`, never the library's global one, so two in one process
(tests, the simulator) keep their figures apart. The `_created` series that
prometheus-client adds to every counter and histogram are turned off: they
double the series and no dashboard of the field reads them.
"""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.exposition import choose_encoder

disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def scrape(registry: CollectorRegistry, request: web.Request) -> web.Response:
    """The format the scraper's Accept header asks for (OpenMetrics, or the text format 0.0.4 by default), chosen
    as prometheus-client's own server chooses it."""
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(registry), headers={"Content-Type": content_type})
