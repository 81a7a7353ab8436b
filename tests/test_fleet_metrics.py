"""What a fleet daemon's ``/metrics`` says about the shared queue (found by a red-team review).

``wsync_jobs_queued`` ("jobs waiting for a slot") was set only by the single daemon's
job manager: a fleet daemon never touched it, so it read 0 whatever waited in the
shared queue, and an alert on a growing queue could never fire.  It now shows the
fleet's queued jobs, as ``GET /v1/status`` does.
"""

from __future__ import annotations

from pathlib import Path

from test_daemon_fleet import fleet, metric, pg_dsn
from test_daemon_harness import make_tree

__all__ = ["pg_dsn"]  # the fixture, used by name


def test_the_queued_gauge_counts_the_fleets_queue(tmp_path: Path, pg_dsn: str) -> None:
    make_tree(tmp_path / "ws", seed=90, big=2 * 1024 * 1024)
    # every exec answers 2 s late: the first pull holds the only slot a while
    box = f'[sandboxes.ws]\nuri = "local:{tmp_path}/ws"\nchaos = "slow=2"\nmax_concurrent = 4\n'
    roots = tmp_path / "roots"
    with fleet(tmp_path, pg_dsn, box, max_concurrent=1) as group:
        daemon = group.add()
        first = daemon.pull("ws", f"{roots}/a")["id"]
        daemon.wait_until(lambda: daemon.job(first)["state"] == "running", what="a running")
        waiting = [daemon.pull("ws", f"{roots}/{name}")["id"] for name in ("b", "c")]
        assert all(daemon.job(j)["state"] == "queued" for j in waiting)
        _, status = daemon.request("GET", "/v1/status")
        assert status["queued"] == 2, status
        daemon.wait_until(
            lambda: metric(daemon, "wsync_jobs_queued") == 2,
            timeout=10,
            what="wsync_jobs_queued to count the two queued jobs",
        )
        assert metric(daemon, "wsync_pulls_in_flight") == 1
        for job_id in (first, *waiting):
            daemon.request("DELETE", f"/v1/pulls/{job_id}")
        daemon.wait_until(
            lambda: metric(daemon, "wsync_jobs_queued") == 0,
            timeout=10,
            what="wsync_jobs_queued to go back to 0",
        )
