"""A fleet daemon killed at awkward moments (reviewer 8): real daemons, real PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

from test_daemon_fleet import fleet, pg_dsn  # noqa: F401 - the fixture
from test_daemon_harness import make_tree


def test_a_cancel_acknowledged_by_the_owner_before_kill9_is_not_undone_by_a_takeover(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811
) -> None:
    """DELETE sent to the daemon that runs the job answers 202; that daemon dies (kill -9)
    while its pull is still stopping.  The daemon that takes the job over must end it
    cancelled, not pull it to the end and swap DEST."""
    make_tree(tmp_path / "ws", seed=8)
    sandbox = f"""
[sandboxes.box]
uri = "local:{tmp_path}/ws"
dest = "{tmp_path}/roots/box"
chaos = "slow=1,close=5"
"""
    with fleet(tmp_path, pg_dsn, sandbox, lease=3.0) as group:
        first = group.add()
        job = first.pull("box")
        first.wait_job(job["id"], states=("running",), timeout=30)
        second = group.add()
        time.sleep(1.5)
        status, body = first.request("DELETE", f"/v1/pulls/{job['id']}")
        assert status == 202, body
        first.kill9()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            final = second.job(job["id"])
            if final["state"] not in ("queued", "running"):
                break
            time.sleep(0.2)
        attempts = group.attempts(job["id"])
    assert final["state"] == "cancelled", (final, attempts)
    assert not (tmp_path / "roots" / "box").exists(), "a cancelled job swapped DEST"


def test_a_job_submitted_on_a_host_whose_clock_is_behind_is_not_pruned_first(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811
) -> None:
    """Two fleet hosts whose clocks disagree by an hour: the fleet keeps the newest
    ``keep_finished_jobs`` finished jobs, and a job that just succeeded is the newest of
    all whichever host took the request; it must not be the one pruned at once."""
    make_tree(tmp_path / "ws", seed=9)
    sandbox = f"""
[sandboxes.box]
uri = "local:{tmp_path}/ws"
dest = "{tmp_path}/roots/box"
"""
    fast = tmp_path / "fast-clock"
    fast.mkdir()
    (fast / "sitecustomize.py").write_text(
        "import time\n_real = time.time\ntime.time = lambda: _real() + 3600.0\n"
    )
    with fleet(tmp_path, pg_dsn, sandbox, lease=3.0, keep_finished_jobs=10) as group:
        ahead = group.add(start=False)
        ahead.env["PYTHONPATH"] = f"{fast}:{ahead.env.get('PYTHONPATH', '')}"
        ahead.start()
        for i in range(10):
            job = ahead.pull("box", f"{tmp_path}/roots/old{i}")
            ahead.wait_job(job["id"], timeout=60)
        ahead.kill9()
        behind = group.add()  # an hour behind the other one
        newest = behind.pull("box")
        behind.wait_job(newest["id"], timeout=60)
        behind.pull("box", f"{tmp_path}/roots/next")  # a new job prunes the finished ones
        time.sleep(1)  # the prune runs beside the answer
        status, body = behind.request("GET", f"/v1/pulls/{newest['id']}")
    assert status == 200, f"the job that just succeeded was pruned at once: {body}"
