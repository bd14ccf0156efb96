"""What the gateway tells operators: Prometheus metrics and memcached STAT groups.

Both read ``gateway.metrics.figures.GatewayStats``, which the fronts keep up to date.

- ``serve_metrics(stats, host, port, per_vbucket=..., health=...)``: ``/metrics``
  over HTTP, with ``/healthz``, ``/readyz``, ``/status.json`` and the status page.
- ``register_gateway_metrics(registry, stats)``: the collector on a registry of
  the caller's.
- ``tap_stat_pairs(stats)``, ``upr_stat_pairs(stats)``: the ``STAT tap`` and
  ``STAT upr`` groups of the gateway's own ports.
"""

from gateway.metrics.collector import GatewayCollector, families, register_gateway_metrics
from gateway.metrics.server import MetricsServer, serve_metrics
from gateway.metrics.stat_groups import tap_stat_pairs, upr_stat_pairs

__all__ = [
    "GatewayCollector",
    "MetricsServer",
    "families",
    "register_gateway_metrics",
    "serve_metrics",
    "tap_stat_pairs",
    "upr_stat_pairs",
]
