"""Prometheus scraping of a Kubernetes deployment: each frontend serves ``/metrics`` (on its HTTP
port; with API keys configured, behind ``Authorization: Bearer KEY`` like the API), each conductor
on its health port (no key: that port serves no API).

Two ways, for the two ways Prometheus finds targets in Kubernetes:
- ServiceMonitors (Prometheus Operator, ``monitoring.coreos.com/v1``) selecting the frontend
  Service's ``http`` port, with ``bearerTokenSecret`` naming the API-key Secret when keys are set,
  and the conductor Service's ``health`` port;
- the ``prometheus.io/*`` annotations on the frontend and conductor pods (scrape configs that keep annotated
  pods). Only the pod is annotated: the common configs scrape annotated pods and annotated
  Services in two jobs, and both would count every series twice. Annotations carry no
  credentials: with an API key, such a scrape config needs its own ``authorization``.
"""

from __future__ import annotations

SERVICE_MONITOR_FILE = "monitoring/servicemonitor.yaml"  # apart: needs the Prometheus Operator's CRDs
METRICS_PATH = "/metrics"
METRICS_KEY = "metrics-api-key"  # the Secret entry Prometheus sends as its bearer token


def scrape_annotations(http_port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(http_port),
            "prometheus.io/path": METRICS_PATH}


def service_monitor(meta: dict, selector: dict[str, str], namespace: str, api_key_secret: str,
                    port: str = "http") -> dict:
    """Scrapes a Service (labels ``selector``: the frontends', the conductors') on its port named ``port``."""
    endpoint: dict = {"port": port, "path": METRICS_PATH, "interval": "15s"}
    if api_key_secret:
        endpoint["bearerTokenSecret"] = {"name": api_key_secret, "key": METRICS_KEY}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
            "spec": {"selector": {"matchLabels": selector}, "namespaceSelector": {"matchNames": [namespace]},
                     "endpoints": [endpoint]}}
