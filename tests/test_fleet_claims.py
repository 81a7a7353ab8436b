"""Which daemon of a fleet may claim a job: placement by resolved roots, and sandbox knowledge.

Real daemons on a real PostgreSQL (a scratch database per test), as in
``test_daemon_fleet``; the truth about who ran a job is read back from
``wsync_attempts``.
"""

from __future__ import annotations

from pathlib import Path

from test_daemon_fleet import Fleet, fleet, fleet_config, pg_dsn, stays_queued, wait_all
from test_daemon_harness import DaemonProcess, assert_same_tree, make_tree

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


def add_own(group: Fleet, name: str, sandboxes: str, env: dict[str, str]) -> DaemonProcess:
    """A daemon of ``group`` with its own ``[sandboxes]`` and environment (config drift)."""
    root = group.tmp / name
    root.mkdir()
    daemon = DaemonProcess(
        root, fleet_config(group.tmp, root, group.dsn, sandboxes, **group.kw), env
    )
    group.daemons.append(daemon)
    return daemon.start()


def test_a_daemon_claims_only_jobs_of_sandboxes_it_has_configured(
    tmp_path: Path, pg_dsn: str
) -> None:
    """Mid-way through a rolling config change: A has sandbox ``ws`` (excluding ``blob.bin``),
    B does not, but allows URIs from a ``local_roots`` that covers ``ws``'s source.  The job
    is pulled with the claiming daemon's config, so B must leave ``ws`` queued while A is busy
    (before: B took it and pulled it with no excludes); A must likewise leave an ad-hoc URI
    job, which it does not allow, to B."""
    make_tree(tmp_path / "ws", seed=80)
    make_tree(tmp_path / "adhoc", seed=81)
    make_tree(tmp_path / "hold", seed=82, big=2 * 1024 * 1024)
    # every exec of ``hold`` answers 2 s late: a pull that keeps its daemon busy for a while
    hold = (
        f'[sandboxes.hold]\nuri = "local:{tmp_path}/hold"\nchaos = "slow=2"\nmax_concurrent = 2\n'
    )
    ws = f'[sandboxes.ws]\nuri = "local:{tmp_path}/ws"\nexclude = ["blob.bin"]\n'
    uris = {"WSYNC_API__ALLOW_URIS": "true", "WSYNC_API__LOCAL_ROOTS": f'["{tmp_path}"]'}
    roots = tmp_path / "roots"
    with fleet(tmp_path, pg_dsn, "", lease=3.0, max_concurrent=1) as group:
        a = add_own(group, "a", hold + ws, {})
        hold_a = a.pull("hold", f"{roots}/hold-a")["id"]
        a.wait_until(lambda: a.job(hold_a)["state"] == "running", what="hold-a running on A")
        b = add_own(group, "b", hold, uris)
        # A is full, B idle: B does not know ``ws``, so the job waits for A
        ws_id = a.pull("ws", f"{roots}/ws")["id"]
        stays_queued(group, [ws_id], seconds=4.0)
        # B full, A freed: A runs ``ws`` (with its excludes) but leaves the ad-hoc job to B
        hold_b = b.pull("hold", f"{roots}/hold-b")["id"]
        b.wait_until(lambda: b.job(hold_b)["state"] == "running", what="hold-b running on B")
        adhoc_id = b.pull(f"local:{tmp_path}/adhoc", f"{roots}/adhoc")["id"]
        assert a.request("DELETE", f"/v1/pulls/{hold_a}")[0] == 202
        [ws_job] = wait_all(a, [ws_id], timeout=120)
        stays_queued(group, [adhoc_id], seconds=4.0)
        assert b.request("DELETE", f"/v1/pulls/{hold_b}")[0] == 202
        [adhoc_job] = wait_all(b, [adhoc_id], timeout=120)
        owners = {j: {x["owner"] for x in group.attempts(j)} for j in (ws_id, adhoc_id)}
        pid_a = a.proc.pid if a.proc else 0
        pid_b = b.proc.pid if b.proc else 0
    assert ws_job["state"] == "succeeded", ws_job
    assert adhoc_job["state"] == "succeeded", adhoc_job
    assert {int(o.split(":")[1]) for o in owners[ws_id]} == {pid_a}, owners
    assert {int(o.split(":")[1]) for o in owners[adhoc_id]} == {pid_b}, owners
    assert not (roots / "ws" / "blob.bin").exists()
    assert (roots / "ws" / "README.md").read_text() == (tmp_path / "ws" / "README.md").read_text()
    assert_same_tree(tmp_path / "adhoc", roots / "adhoc")
