"""Daemon durability probes (reviewer 8): kill -9 and reload at awkward moments."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

from test_daemon_harness import DaemonProcess, base_config, make_tree


def test_a_cancel_acknowledged_before_kill9_is_not_undone_by_the_restart(tmp_path: Path) -> None:
    """DELETE of a running job answers 202; the daemon dies (kill -9) while that pull is
    still stopping.  The restart must not pull the job to the end and swap DEST: the
    cancel was acknowledged to the client."""
    make_tree(tmp_path / "ws", seed=3)
    roots = tmp_path / "roots"
    roots.mkdir()
    # every exec answers 1 s late (the pull is still running when the DELETE comes), and
    # the transport takes 5 s to close (the cancelled pull is still stopping at the kill)
    config = base_config(
        tmp_path,
        f"""
[sandboxes.box]
uri = "local:{tmp_path}/ws"
dest = "{roots}/box"
chaos = "slow=1,close=5"
""",
    )
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.start()
        job = daemon.pull("box")
        daemon.wait_job(job["id"], states=("running",), timeout=30)
        time.sleep(1.5)
        status, body = daemon.request("DELETE", f"/v1/pulls/{job['id']}")
        assert status == 202, body
        daemon.kill9()
        daemon.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            final = daemon.job(job["id"])
            if final["state"] not in ("queued", "running"):
                break
            time.sleep(0.2)
    finally:
        daemon.close()
    assert final["state"] == "cancelled", final
    assert not (roots / "box").exists(), "a cancelled job swapped DEST after the restart"


def test_a_jobs_db_of_an_older_wsync_is_migrated_and_its_jobs_resume(tmp_path: Path) -> None:
    """A jobs.db written before the ``cancel_requested`` column existed still opens, and
    the job it left running is pulled again."""
    make_tree(tmp_path / "ws", seed=4)
    roots = tmp_path / "roots"
    roots.mkdir()
    (tmp_path / "state").mkdir()
    with sqlite3.connect(tmp_path / "state" / "jobs.db") as db:
        db.executescript(
            """
CREATE TABLE jobs (id TEXT PRIMARY KEY, sandbox TEXT NOT NULL, uri TEXT NOT NULL,
    dest TEXT NOT NULL, state TEXT NOT NULL, trigger TEXT NOT NULL, created_at REAL NOT NULL,
    started_at REAL, finished_at REAL, attempts INTEGER NOT NULL DEFAULT 0,
    progress TEXT NOT NULL DEFAULT '{}', result TEXT, error TEXT, error_kind TEXT,
    exit_code INTEGER);
"""
        )
        db.execute(
            "INSERT INTO jobs (id, sandbox, uri, dest, state, trigger, created_at, attempts) "
            "VALUES ('j-old', 'box', ?, ?, 'running', 'api', ?, 1)",
            (f"local:{tmp_path}/ws", f"{roots}/box", time.time()),
        )
    config = base_config(
        tmp_path, f'[sandboxes.box]\nuri = "local:{tmp_path}/ws"\ndest = "{roots}/box"\n'
    )
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.start()
        done = daemon.wait_job("j-old", timeout=60)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
    finally:
        daemon.close()
    assert done["attempts"] == 2, done


def test_a_reload_does_not_pull_every_scheduled_sandbox_again(tmp_path: Path) -> None:
    """``systemctl reload`` (SIGHUP) re-reads the config; a sandbox pulled every 30 s is
    still pulled about every 30 s, not once more after every reload."""
    make_tree(tmp_path / "ws", seed=5)
    roots = tmp_path / "roots"
    roots.mkdir()
    config = base_config(
        tmp_path,
        f"""
[sandboxes.tick]
uri = "local:{tmp_path}/ws"
dest = "{roots}/tick"
interval = 30
jitter = 0.1
""",
    )
    daemon = DaemonProcess(tmp_path, config)

    def fired() -> list[dict[str, object]]:
        status, body = daemon.request("GET", "/v1/pulls?sandbox=tick")
        assert status == 200, body
        return [job for job in body["jobs"] if job["trigger"] == "schedule"]

    try:
        daemon.start()
        daemon.wait_until(lambda: len(fired()) == 1, timeout=10, what="the first scheduled pull")
        for _ in range(3):
            time.sleep(4)
            daemon.signal(signal.SIGHUP)
        time.sleep(4)
        jobs = fired()
    finally:
        daemon.close()
    assert daemon.log().count("config.reloaded") >= 1
    assert len(jobs) == 1, f"{len(jobs)} scheduled pulls in ~20 s of a 30 s interval"


def test_a_job_that_just_ended_survives_the_prune_after_the_clock_stepped_back(
    tmp_path: Path,
) -> None:
    """The host's clock stepped back an hour (NTP correcting a fast clock, a VM restored
    from a snapshot): the jobs recorded before the step have later ``created_at`` than
    any new one.  Pruning keeps the newest ``keep_finished_jobs`` finished jobs; a job
    that just ended is the newest of all, and must not be the first one dropped."""
    make_tree(tmp_path / "ws", seed=6)
    roots = tmp_path / "roots"
    roots.mkdir()
    config = base_config(
        tmp_path,
        f"""
[sandboxes.a]
uri = "local:{tmp_path}/ws"
dest = "{roots}/a"
[sandboxes.b]
uri = "local:{tmp_path}/ws"
dest = "{roots}/b"
""",
        keep_finished_jobs=10,
    )
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.start()  # creates jobs.db
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
        ahead = time.time() + 3600  # recorded before the clock went back an hour
        with sqlite3.connect(tmp_path / "state" / "jobs.db") as db:
            for i in range(10):
                db.execute(
                    "INSERT INTO jobs (id, sandbox, uri, dest, state, trigger, created_at, "
                    "finished_at) VALUES (?, 'a', 'local:/x', ?, 'succeeded', 'api', ?, ?)",
                    (f"j-old-{i}", f"{roots}/old{i}", ahead + i, ahead + i),
                )
        daemon.start()
        first = daemon.pull("a")
        daemon.wait_job(first["id"], timeout=60)
        daemon.pull("b")  # a new job prunes the finished ones
        status, body = daemon.request("GET", f"/v1/pulls/{first['id']}")
    finally:
        daemon.close()
    assert status == 200, f"the job that just succeeded was pruned at once: {body}"
