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
