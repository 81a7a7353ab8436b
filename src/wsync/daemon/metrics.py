"""Prometheus metrics: what an operator needs to see a backend losing bytes.

The integrity-fault counter is the point of this module (and the breakdown of
retries by reason: every retry is caused by a detected fault, counted by kind;
the engine reports retries only as a total).  wsync *survives*
head truncation, fabricated exits and hash mismatches by retrying, so a pull
that succeeds can still hide a backend that is silently corrupting streams;
``wsync_integrity_faults_total{kind=...}`` makes that visible and alertable.

A private :class:`CollectorRegistry` (not the process-global one) keeps tests
and embedding free of duplicate-registration errors.  The ``sandbox`` label is
a configured sandbox name, or ``adhoc`` for URIs given in a request, so label
cardinality stays bounded by the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

#: pull durations span seconds to an hour
DURATION_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class Metrics:
    """All daemon metrics, registered on one private registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.pulls = Counter(
            "wsync_pulls", "Finished pulls by result", ["sandbox", "result"], registry=r
        )
        self.bytes = Counter(
            "wsync_pull_archive_bytes",
            "Archive bytes of successful pulls (compressed stream length)",
            ["sandbox"],
            registry=r,
        )
        self.transferred = Counter(
            "wsync_transferred_bytes",
            "Bytes read over transports, retries included",
            ["sandbox"],
            registry=r,
        )
        self.chunks = Counter(
            "wsync_chunks", "Chunks verified and journaled", ["sandbox"], registry=r
        )
        self.resumed = Counter(
            "wsync_resumed_chunks",
            "Chunks taken from a durable journal instead of fetched again",
            ["sandbox"],
            registry=r,
        )
        self.retries = Counter(
            "wsync_chunk_retries",
            "Guest calls retried (the reasons are in wsync_integrity_faults_total by kind)",
            ["sandbox"],
            registry=r,
        )
        self.faults = Counter(
            "wsync_integrity_faults",
            "Integrity faults detected in guest output, by kind (no-envelope, truncated, ...)",
            ["sandbox", "kind"],
            registry=r,
        )
        self.modes = Counter(
            "wsync_pull_modes",
            "Successful pulls by mode: full (the whole tree crossed) or incremental",
            ["sandbox", "mode"],
            registry=r,
        )
        self.changed = Counter(
            "wsync_changed_files",
            "Entries fetched (or directories re-created) by successful pulls",
            ["sandbox"],
            registry=r,
        )
        self.deleted = Counter(
            "wsync_deleted_files",
            "Entries removed from DEST by successful pulls",
            ["sandbox"],
            registry=r,
        )
        self.tree_bytes = Counter(
            "wsync_tree_bytes",
            "Bytes of the trees that successful pulls left in DEST (set against "
            "wsync_transferred_bytes_total: what an incremental pull saved)",
            ["sandbox"],
            registry=r,
        )
        self.last_transferred = Gauge(
            "wsync_last_pull_transferred_bytes",
            "Bytes read over the transport by the last successful pull",
            ["sandbox"],
            registry=r,
        )
        self.last_tree = Gauge(
            "wsync_last_pull_tree_bytes",
            "Bytes of the tree in DEST after the last successful pull",
            ["sandbox"],
            registry=r,
        )
        self.duration = Histogram(
            "wsync_pull_duration_seconds",
            "Wall time of one pull attempt",
            ["result"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("wsync_pulls_in_flight", "Pulls running now", registry=r)
        self.queued = Gauge("wsync_jobs_queued", "Jobs waiting for a slot", registry=r)
        self.reloads = Counter(
            "wsync_config_reloads", "Configuration reloads by outcome", ["outcome"], registry=r
        )
        # a fleet on PostgreSQL (store = "postgresql://..."); zero with SQLite
        self.claims = Counter(
            "wsync_fleet_claims", "Jobs this daemon claimed from the shared store", registry=r
        )
        self.renewals = Counter(
            "wsync_fleet_lease_renewals",
            "Lease renewals by outcome: ok, or lost (another daemon owns the job now)",
            ["outcome"],
            registry=r,
        )
        self.takeovers = Counter(
            "wsync_fleet_takeovers",
            "Jobs claimed after another daemon's lease ran out",
            registry=r,
        )
        self.fenced = Counter(
            "wsync_fleet_fenced_writes",
            "Writes of a job refused because another daemon holds a newer fencing token",
            registry=r,
        )
        self.schedule_fires = Counter(
            "wsync_fleet_schedule_fires",
            "Periodic runs this daemon won from the shared schedule, by outcome: queued, or "
            "reconciled (the sandbox's previous pull was still active)",
            ["outcome"],
            registry=r,
        )
        self.store_errors = Counter(
            "wsync_fleet_store_errors",
            "Statements the shared store failed (unreachable, restarted); retried with backoff",
            registry=r,
        )

    def observe_pull(
        self, sandbox: str, state: str, elapsed: float, summary: Mapping[str, Any]
    ) -> None:
        """Record one finished pull attempt from its result summary (PullResult.to_json shape)."""
        self.pulls.labels(sandbox, state).inc()
        self.duration.labels(state).observe(max(elapsed, 0.0))
        if state == "succeeded":
            self.bytes.labels(sandbox).inc(int(summary.get("bytes") or 0))
            self.modes.labels(sandbox, str(summary.get("mode") or "full")).inc()
            self.changed.labels(sandbox).inc(int(summary.get("changed_files") or 0))
            self.deleted.labels(sandbox).inc(int(summary.get("deleted_files") or 0))
            tree = int(summary.get("tree_bytes") or 0)
            self.tree_bytes.labels(sandbox).inc(tree)
            self.last_tree.labels(sandbox).set(tree)
            self.last_transferred.labels(sandbox).set(int(summary.get("transferred_bytes") or 0))
        self.transferred.labels(sandbox).inc(int(summary.get("transferred_bytes") or 0))
        self.chunks.labels(sandbox).inc(int(summary.get("chunks") or 0))
        self.resumed.labels(sandbox).inc(int(summary.get("resumed_chunks") or 0))
        self.retries.labels(sandbox).inc(int(summary.get("retries") or 0))
        faults: Mapping[str, Any] = summary.get("faults") or {}
        for kind, count in faults.items():
            if int(count) > 0:
                self.faults.labels(sandbox, str(kind)).inc(int(count))

    def render(self) -> bytes:
        return generate_latest(self.registry)
