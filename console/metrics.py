"""Prometheus metrics, one registry per app instance (no labels that carry user data)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "umbra_console_http_requests",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "umbra_console_http_request_duration_seconds",
            "Request latency by route template (long polls included).",
            ["route"],
            registry=self.registry,
        )
        self.traffic_inserted = Counter(
            "umbra_console_traffic_records_inserted",
            "Traffic-log records stored.",
            registry=self.registry,
        )
        self.traffic_duplicates = Counter(
            "umbra_console_traffic_records_duplicate",
            "Traffic-log records received again (retries) and not stored twice.",
            registry=self.registry,
        )
        self.long_polls = Gauge(
            "umbra_console_long_polls_waiting",
            "Long polls currently waiting.",
            registry=self.registry,
        )
        self.audit_entries = Counter(
            "umbra_console_audit_entries",
            "Audit-log entries appended.",
            registry=self.registry,
        )
        self.secret_releases = Counter(
            "umbra_console_secret_releases",
            "Attested secret releases by outcome.",
            ["outcome"],
            registry=self.registry,
        )
