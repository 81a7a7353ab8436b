"""Which daemon of a fleet may claim a job: placement by resolved roots, and sandbox knowledge.

Real daemons on a real PostgreSQL (a scratch database per test), as in
``test_daemon_fleet``; the truth about who ran a job is read back from
``wsync_attempts``.
"""

from __future__ import annotations

from pathlib import Path

from test_daemon_fleet import fleet, pg_dsn
from test_daemon_harness import assert_same_tree, make_tree

__all__ = ["pg_dsn"]  # the fixture, used by name


def test_a_dest_root_reached_through_a_symlink_still_gets_its_jobs_claimed(
    tmp_path: Path, pg_dsn: str
) -> None:
    """``dest_roots = [".../link"]`` with ``link -> real``: the job's DEST is stored resolved
    (``.../real/ws``), so placement must compare it with the resolved root, or no daemon
    ever claims the job and it stays queued for good."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    make_tree(tmp_path / "ws", seed=70)
    box = f'[sandboxes.ws]\nuri = "local:{tmp_path}/ws"\ndest = "{tmp_path}/link/ws"\n'
    with fleet(tmp_path, pg_dsn, box, roots=("link",)) as group:
        daemon = group.add()
        job = daemon.pull("ws")
        assert job["dest"] == f"{tmp_path}/real/ws"
        done = daemon.wait_job(job["id"], timeout=60)
        attempts = group.attempts(job["id"])
    assert done["state"] == "succeeded"
    assert [a["outcome"] for a in attempts] == ["succeeded"], attempts
    assert_same_tree(tmp_path / "ws", tmp_path / "real" / "ws")
