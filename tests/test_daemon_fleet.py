"""A fleet of real daemon processes sharing one real PostgreSQL (issue 12).

Every test gets a fresh database (``wsync.testing.pg.scratch_database``) and
starts ``python -m wsync.daemon`` processes with ``store = "postgresql://…"``;
they share ``dest_roots`` and ``engine_dir`` as daemons on a shared volume
would.  The truth is read back from the database itself: ``wsync_attempts``
has one row per claim (owner, fence, start, end, outcome), which is how
"exactly once" and "never two at once" are checked.

Without PostgreSQL these tests skip on a developer machine and fail under
``CI`` (``scripts/test.sh`` starts one).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import itertools
import json
import os
import re
import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from test_daemon_harness import TOKEN, DaemonProcess, assert_same_tree, make_tree
from wsync.testing.pg import PgUnavailable, scratch_database, throwaway_cluster, with_address
from wsync.testing.sshd import SshdServer
from wsync.testing.tcpproxy import TcpProxy

BIG = 24 * 1024 * 1024


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    try:
        with scratch_database() as dsn:
            yield dsn
    except PgUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required here (scripts/test.sh starts one): {err}")
        pytest.skip(str(err))


def fleet_config(
    tmp: Path,
    root: Path,
    dsn: str,
    sandboxes: str,
    *,
    lease: float = 3.0,
    roots: tuple[str, ...] = ("roots",),
    **limits: int,
) -> str:
    lim = "\n".join(f"{k} = {v}" for k, v in limits.items())
    dest_roots = ", ".join(f'"{tmp}/{r}"' for r in roots)
    return f"""
state_dir = "{root}/state"
dest_roots = [{dest_roots}]
engine_dir = "{tmp}/engine"
store = "{dsn}"
lease_seconds = {lease}
shutdown_grace = 10

[api]
listen = "127.0.0.1:0"

[limits]
chunk_size = 65536
call_timeout = 20
{lim}
{sandboxes}
"""


class Fleet:
    """Daemons ``d0``, ``d1``, … on one database; closed (killed) at the end of the test."""

    def __init__(self, tmp: Path, dsn: str, sandboxes: str, **kw: Any) -> None:
        self.tmp, self.dsn, self.sandboxes, self.kw = tmp, dsn, sandboxes, kw
        self.daemons: list[DaemonProcess] = []
        for name in kw.get("roots", ("roots",)):
            (tmp / name).mkdir(exist_ok=True)

    def add(self, start: bool = True, **kw: Any) -> DaemonProcess:
        """One more daemon; ``kw`` overrides the fleet's config options (``roots``, limits)."""
        root = self.tmp / f"d{len(self.daemons)}"
        root.mkdir()
        options = {**self.kw, **kw}
        for name in options.get("roots", ()):
            (self.tmp / name).mkdir(exist_ok=True)
        daemon = DaemonProcess(
            root, fleet_config(self.tmp, root, self.dsn, self.sandboxes, **options)
        )
        self.daemons.append(daemon)
        return daemon.start() if start else daemon

    def add_many(self, count: int) -> list[DaemonProcess]:
        """Start ``count`` daemons at once (a start is mostly imports: in parallel it is quick)."""
        fresh = [self.add(start=False) for _ in range(count)]
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            return list(pool.map(lambda d: d.start(), fresh))

    def owner_of(self, job_id: str) -> tuple[DaemonProcess, DaemonProcess]:
        """(the daemon holding the job's lease, another one), once it is claimed."""
        owner = self.daemons[0].wait_until(
            lambda: self.sql("SELECT owner FROM wsync_jobs WHERE id = %s", job_id)[0][0],
            what="a claim",
        )
        pid = int(str(owner).split(":")[1])
        holder = next(d for d in self.daemons if d.proc is not None and d.proc.pid == pid)
        return holder, next(d for d in self.daemons if d is not holder)

    def close(self) -> None:
        for daemon in self.daemons:
            if daemon.proc is not None and daemon.proc.poll() is None:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            daemon.close()

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(query, params).fetchall())  # type: ignore[arg-type]

    def attempts(self, job_id: str | None = None) -> list[dict[str, Any]]:
        rows = self.sql(
            "SELECT job_id, fence, owner, sandbox, dest, takeover, "
            "extract(epoch FROM started_at)::float8, extract(epoch FROM ended_at)::float8, outcome "
            "FROM wsync_attempts WHERE %s::text IS NULL OR job_id = %s ORDER BY started_at",
            job_id,
            job_id,
        )
        keys = (
            "job_id",
            "fence",
            "owner",
            "sandbox",
            "dest",
            "takeover",
            "start",
            "end",
            "outcome",
        )
        return [dict(zip(keys, row, strict=True)) for row in rows]


@contextlib.contextmanager
def fleet(tmp: Path, dsn: str, sandboxes: str, **kw: Any) -> Iterator[Fleet]:
    group = Fleet(tmp, dsn, sandboxes, **kw)
    try:
        yield group
    finally:
        group.close()


def metric(daemon: DaemonProcess, name: str, labels: str = "") -> float:
    """Sum of ``name`` over its label sets (only those containing ``labels``, if given)."""
    status, text = daemon.request("GET", "/metrics", token=None)
    assert status == 200
    total = 0.0
    for line in str(text).splitlines():
        found = re.match(rf"{name}(\{{.*\}})? ", line)
        if found and labels in (found.group(1) or ""):
            total += float(line.rsplit(" ", 1)[1])
    return total


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """Most spans open at one instant."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def wait_all(daemon: DaemonProcess, ids: list[str], timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        answers = [daemon.request("GET", f"/v1/pulls/{i}") for i in ids]
        if any(status != 200 for status, _ in answers):  # 503 while the store is back
            assert all(status in (200, 503) for status, _ in answers), answers
            time.sleep(0.2)
            continue
        jobs = [job for _, job in answers]
        if all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs):
            return jobs
        if time.monotonic() > deadline:
            pending = [(j["id"], j["state"]) for j in jobs if j["state"] in ("queued", "running")]
            pytest.fail(f"jobs not done after {timeout}s: {pending}\n{daemon.log()}")
        time.sleep(0.2)


def big_sandbox(tmp: Path) -> str:
    make_tree(tmp / "ws", seed=5, big=BIG)
    return f"""
[sandboxes.big]
uri = "local:{tmp}/ws"
dest = "{tmp}/roots/big"
parallel = 1
chunk_size = 131072
"""


def running_at(group: Fleet, job_id: str, chunks: int) -> tuple[int, DaemonProcess, DaemonProcess]:
    """Wait until the owner (asked directly: its progress is live, the store's is up to 2 s
    old) has journaled ``chunks``; returns (chunks done, owner, another daemon)."""
    owner, other = group.owner_of(job_id)
    return chunks_done(owner, job_id, chunks), owner, other


def chunks_done(daemon: DaemonProcess, job_id: str, at_least: int) -> int:
    def progressed() -> int:
        job = daemon.job(job_id)
        assert job["state"] in ("queued", "running"), job
        done = int(job["progress"].get("chunks_done") or 0)
        return done if job["state"] == "running" and done >= at_least else 0

    return int(daemon.wait_until(progressed, timeout=60, what=f"{at_least} chunks"))


# -- tests ----------------------------------------------------------------------


def test_three_daemons_pull_thirty_sandboxes_exactly_once(
    tmp_path: Path, pg_dsn: str, sshd: SshdServer
) -> None:
    """30 distinct sandboxes (local: and ssh://) plus one sandbox into three DESTs, submitted
    round-robin to three daemons: every job lands exact, claimed exactly once, and neither
    the per-sandbox limit (1) nor the fleet limit (4) is ever exceeded."""
    opts = sshd.transport_options()
    boxes = []
    for i in range(30):
        make_tree(tmp_path / f"ws{i}", seed=100 + i)
        if i % 3 == 2:
            uri = sshd.uri(str(tmp_path / f"ws{i}"))
            extra = (
                f'options = {{ ssh_key = "{opts["ssh_key"]}", '
                f'known_hosts = "{opts["known_hosts"]}", ssh_config = "none" }}'
            )
        else:
            uri, extra = f"local:{tmp_path}/ws{i}", ""
        boxes.append(f'[sandboxes.s{i}]\nuri = "{uri}"\ndest = "{tmp_path}/roots/s{i}"\n{extra}\n')
    make_tree(tmp_path / "shared", seed=99)
    boxes.append(f'[sandboxes.shared]\nuri = "local:{tmp_path}/shared"\n')
    # a long lease: a renewal late on a loaded machine lets a live job look dead (its
    # slot then counts as free, by design), and this test is about the limits, not expiry
    with fleet(
        tmp_path, pg_dsn, "\n".join(boxes), lease=30.0, max_concurrent=3, fleet_max_concurrent=4
    ) as group:
        daemons = group.add_many(3)
        ids = []
        for i in range(30):
            ids.append(daemons[i % 3].pull(f"s{i}")["id"])
        for k in range(3):
            ids.append(daemons[k].pull("shared", f"{tmp_path}/roots/shared{k}")["id"])
        jobs = wait_all(daemons[2], ids, timeout=120)
        attempts = group.attempts()
        claims = [metric(d, "wsync_fleet_claims_total") for d in daemons]
    assert [j["state"] for j in jobs] == ["succeeded"] * 33, [j for j in jobs if j["error"]]
    for i in range(30):
        assert_same_tree(tmp_path / f"ws{i}", tmp_path / "roots" / f"s{i}")
    for k in range(3):
        assert_same_tree(tmp_path / "shared", tmp_path / "roots" / f"shared{k}")
    # exactly once: one claim per job, and it succeeded
    assert sorted(a["job_id"] for a in attempts) == sorted(ids)
    assert {a["outcome"] for a in attempts} == {"succeeded"}
    assert sum(claims) == 33 and sum(1 for c in claims if c) >= 2, claims
    spans = [(a["start"], a["end"]) for a in attempts]
    shared = [(a["start"], a["end"]) for a in attempts if a["sandbox"] == "shared"]
    overlap, shared_overlap = max_overlap(spans), max_overlap(shared)
    print(f"fleet overlap: {overlap} at once (limit 4), shared sandbox: {shared_overlap}")
    assert 2 <= overlap <= 4, spans
    assert shared_overlap == 1, shared


def test_kill9_owner_another_daemon_takes_over_and_resumes(tmp_path: Path, pg_dsn: str) -> None:
    with fleet(tmp_path, pg_dsn, big_sandbox(tmp_path), lease=3.0) as group:
        daemons = group.add_many(2)
        job = daemons[0].pull("big")
        before, first, second = running_at(group, job["id"], 8)
        first.kill9()
        killed = time.time()
        done = second.wait_job(job["id"], timeout=120)
        attempts = group.attempts(job["id"])
        # the killed daemon, restarted, leaves the job alone
        first.start()
        time.sleep(1.5)  # a claim poll or two
        assert first.job(job["id"])["state"] == "succeeded"
        assert group.attempts(job["id"]) == attempts
        assert metric(first, "wsync_fleet_claims_total") == 0
        assert metric(second, "wsync_fleet_takeovers_total") == 1
    assert_same_tree(tmp_path / "ws", tmp_path / "roots" / "big")
    assert [a["outcome"] for a in attempts] == ["expired", "succeeded"], attempts
    assert attempts[1]["takeover"] and attempts[1]["fence"] == attempts[0]["fence"] + 1
    result = done["result"]
    assert result["reconciled"] or result["resumed_chunks"] >= before, result
    assert result["resumed_chunks"] >= before, result
    print(f"takeover {attempts[1]['start'] - killed:.2f}s after kill -9 (lease 3s)")


def test_sigterm_hands_the_job_back_at_once_and_another_daemon_resumes(
    tmp_path: Path, pg_dsn: str
) -> None:
    """With a 60 s lease, only a hand-back (not an expiry) lets the other daemon go on now."""
    with fleet(tmp_path, pg_dsn, big_sandbox(tmp_path), lease=60.0) as group:
        daemons = group.add_many(2)
        job = daemons[0].pull("big")
        before, first, second = running_at(group, job["id"], 8)
        first.signal(signal.SIGTERM)
        assert first.wait_exit(timeout=40) == 0, first.log()
        done = second.wait_job(job["id"], timeout=50)
        attempts = group.attempts(job["id"])
    assert_same_tree(tmp_path / "ws", tmp_path / "roots" / "big")
    assert [a["outcome"] for a in attempts] == ["released", "succeeded"], attempts
    assert not attempts[1]["takeover"]
    assert done["result"]["resumed_chunks"] >= before, done["result"]


def test_frozen_owner_is_fenced_and_the_new_owner_lands_dest(tmp_path: Path, pg_dsn: str) -> None:
    with fleet(tmp_path, pg_dsn, big_sandbox(tmp_path), lease=2.0) as group:
        daemons = group.add_many(2)
        job = daemons[0].pull("big")
        _, first, second = running_at(group, job["id"], 8)
        assert first.proc is not None
        first.signal(signal.SIGSTOP)
        try:
            # the lease runs out; the second daemon takes the job over (and, while the
            # frozen one still holds the journal's lock, hands it back and retries)
            second.wait_until(
                lambda: metric(second, "wsync_fleet_takeovers_total") >= 1,
                timeout=30,
                what="a takeover",
            )
        finally:
            first.signal(signal.SIGCONT)
        done = second.wait_job(job["id"], timeout=120)
        first.wait_until(
            lambda: metric(first, "wsync_fleet_fenced_writes_total") >= 1,
            timeout=30,
            what="the frozen daemon's write refused",
        )
        attempts = group.attempts(job["id"])
        status, _ = first.request("GET", "/readyz", token=None)
        assert status == 200
    assert_same_tree(tmp_path / "ws", tmp_path / "roots" / "big")
    assert attempts[0]["outcome"] == "fenced", attempts
    # the other daemon took the job over; where the frozen one still held the journal's
    # lock it handed the job back, and whichever daemon claimed it next landed DEST, the
    # once frozen one included (seen under a loaded CI), always under a newer fence
    assert any(a["owner"] != attempts[0]["owner"] for a in attempts[1:]), attempts
    winner = [a for a in attempts if a["outcome"] == "succeeded"]
    assert len(winner) == 1 and winner[0]["fence"] > attempts[0]["fence"], attempts
    assert done["state"] == "succeeded" and done["result"]["ok"]


def test_placement_runs_each_job_only_on_a_daemon_whose_root_holds_its_dest(
    tmp_path: Path, pg_dsn: str
) -> None:
    """d0 serves only ``ra/``, d1 only ``rb/`` (per-host disks).  ``dest_roots`` both confines
    requests and places jobs, so each daemon accepts only its own roots' DESTs; the test
    makes the wrong daemon idle while the right one cannot claim (it is full: one slot and
    a slow ``hold`` pull), which is when a placement bug would show: the idle daemon
    claims.  Then d0 stops, and its root's jobs wait for it rather than run elsewhere."""
    # every exec of ``hold`` answers 2 s late: a pull that keeps its daemon busy for a while
    boxes = (
        f'[sandboxes.hold]\nuri = "local:{tmp_path}/hold"\nchaos = "slow=2"\nmax_concurrent = 2\n'
    )
    boxes += "".join(f'[sandboxes.s{i}]\nuri = "local:{tmp_path}/ws{i}"\n' for i in range(3))
    make_tree(tmp_path / "hold", seed=40, big=2 * 1024 * 1024)
    for i in range(3):
        make_tree(tmp_path / f"ws{i}", seed=41 + i)
    renewals = "wsync_fleet_lease_renewals_total"
    with fleet(tmp_path, pg_dsn, boxes, lease=3.0, max_concurrent=1) as group:
        d0, d1 = group.add(roots=("ra",)), group.add(roots=("rb",))
        pid0 = d0.proc.pid if d0.proc else 0

        def dests(root: str) -> list[str]:
            return [f"{tmp_path}/{root}/s{i}" for i in range(3)]

        # d1 busy, rb jobs queued, d0 idle: d0 must leave them
        hold_b = d1.pull("hold", f"{tmp_path}/rb/hold")["id"]
        d1.wait_until(lambda: d1.job(hold_b)["state"] == "running", what="hold-b running")
        b_ids = [d1.pull(f"s{i}", dest)["id"] for i, dest in enumerate(dests("rb"))]
        stays_queued(group, b_ids, seconds=3.0)
        # d0 busy, ra jobs queued; d1 freed (hold-b cancelled) runs rb's and then idles
        hold_a = d0.pull("hold", f"{tmp_path}/ra/hold")["id"]
        d0.wait_until(lambda: d0.job(hold_a)["state"] == "running", what="hold-a running")
        a_ids = [d0.pull(f"s{i}", dest)["id"] for i, dest in enumerate(dests("ra"))]
        assert d1.request("DELETE", f"/v1/pulls/{hold_b}")[0] == 202
        wait_all(d1, b_ids, timeout=120)
        stays_queued(group, a_ids, seconds=3.0)
        # a pull that outlived several renewal intervals (lease 3 s: one each 0.75 s)
        assert metric(d0, renewals, 'outcome="ok"') > 0
        assert d0.job(hold_a)["state"] == "running", "hold-a ended too soon for this test"
        # no live daemon serves ra: its jobs wait, d1 stays idle
        d0.signal(signal.SIGTERM)
        assert d0.wait_exit(timeout=40) == 0, d0.log()
        stays_queued(group, [hold_a, *a_ids], seconds=3.0, claimed_before=frozenset([hold_a]))
        # d0 is back (a new owner id): it runs ra's jobs (hold-a, slow, is dropped first)
        assert d1.request("DELETE", f"/v1/pulls/{hold_a}")[0] == 202
        d0.start()
        pid0_again = d0.proc.pid if d0.proc else 0
        jobs = wait_all(d0, a_ids, timeout=120)
        attempts = group.attempts()
        d1_claims = metric(d1, "wsync_fleet_claims_total")
    assert [j["state"] for j in jobs] == ["succeeded"] * 3, jobs
    for i in range(3):
        assert_same_tree(tmp_path / f"ws{i}", tmp_path / "ra" / f"s{i}")
        assert_same_tree(tmp_path / f"ws{i}", tmp_path / "rb" / f"s{i}")
    assert not (tmp_path / "rb" / "hold").exists() and not (tmp_path / "ra" / "hold").exists()
    pid1 = d1.proc.pid if d1.proc else 0
    by_root = {"ra": {pid0, pid0_again}, "rb": {pid1}}
    for a in attempts:
        root = Path(a["dest"]).parent.name
        assert int(a["owner"].split(":")[1]) in by_root[root], (a, by_root)
    assert sorted(a["job_id"] for a in attempts if a["dest"].startswith(f"{tmp_path}/rb/")) == (
        sorted([hold_b, *b_ids])
    )
    assert d1_claims == 4  # hold-b and the three rb jobs, nothing of ra's


def stays_queued(
    group: Fleet, ids: list[str], seconds: float, claimed_before: frozenset[str] = frozenset()
) -> None:
    """For ``seconds`` (several claim polls), every job in ``ids`` is queued and gains no
    claim (jobs in ``claimed_before`` keep the claims they had)."""
    before = {a["job_id"]: a for a in group.attempts() if a["job_id"] in claimed_before}
    deadline = time.monotonic() + seconds
    while True:
        states = dict(group.sql("SELECT id, state FROM wsync_jobs WHERE id = ANY(%s)", ids))
        assert states == dict.fromkeys(ids, "queued"), states
        claims = [a for a in group.attempts() if a["job_id"] in ids]
        assert len(claims) == len(before), claims
        if time.monotonic() > deadline:
            return
        time.sleep(0.3)


@pytest.mark.parametrize("outage", ["proxy-cut", "server-restart"])
def test_store_outage_mid_run_every_job_ends_exactly_once(
    tmp_path: Path, outage: str, request: pytest.FixtureRequest
) -> None:
    """PostgreSQL goes away mid-run and comes back.  ``proxy-cut``: every connection through
    a TCP proxy in front of the shared server is cut and refused for a while (the server
    itself, shared by other tests, keeps running).  ``server-restart``: a cluster this test
    initdb'd and owns is really stopped (fast shutdown: every session terminated, the
    LISTEN too) and started again; skipped where no PostgreSQL server binaries are."""
    boxes = []
    for i in range(4):
        make_tree(tmp_path / f"ws{i}", seed=200 + i, big=2 * 1024 * 1024)
        boxes.append(
            f'[sandboxes.o{i}]\nuri = "local:{tmp_path}/ws{i}"\ndest = "{tmp_path}/roots/o{i}"\n'
            "parallel = 1\n"
        )
    with contextlib.ExitStack() as stack:
        if outage == "proxy-cut":
            dsn = request.getfixturevalue("pg_dsn")
            server = urllib.parse.urlsplit(dsn)
            proxy = stack.enter_context(
                TcpProxy(server.hostname or "127.0.0.1", server.port or 5432)
            )
            through = with_address(dsn, "127.0.0.1", proxy.port)
            cut, restore = proxy.cut, proxy.restore
        else:
            try:
                cluster = stack.enter_context(throwaway_cluster())
            except PgUnavailable as err:
                pytest.skip(f"no PostgreSQL cluster of our own to restart: {err}")
            dsn = through = stack.enter_context(scratch_database(cluster.dsn))
            cut, restore = cluster.stop, cluster.start
        with fleet(tmp_path, through, "\n".join(boxes), lease=10.0, max_concurrent=2) as group:
            daemons = group.add_many(2)
            ids = [daemons[i % 2].pull(f"o{i}")["id"] for i in range(4)]
            daemons[0].wait_until(
                lambda: daemons[0].job(ids[0])["state"] == "running", what="a running pull"
            )
            cut()
            for daemon in daemons:
                daemon.wait_until(
                    lambda d=daemon: d.request("GET", "/readyz", token=None)[0] == 503,
                    timeout=20,
                    what="/readyz 503 during the outage",
                )
            time.sleep(1)
            restore()
            jobs = wait_all(daemons[1], ids, timeout=120)
            for daemon in daemons:
                daemon.wait_until(
                    lambda d=daemon: d.request("GET", "/readyz", token=None)[0] == 200,
                    timeout=20,
                    what="/readyz 200 after the outage",
                )
            errors = sum(metric(d, "wsync_fleet_store_errors_total") for d in daemons)
        attempts = Fleet(tmp_path, dsn, "").attempts()
    assert [j["state"] for j in jobs] == ["succeeded"] * 4, jobs
    for i in range(4):
        assert_same_tree(tmp_path / f"ws{i}", tmp_path / "roots" / f"o{i}")
    assert errors > 0
    for job_id in ids:
        won = [a for a in attempts if a["job_id"] == job_id and a["outcome"] == "succeeded"]
        assert len(won) == 1, attempts
    by_job: dict[str, list[tuple[float, float]]] = {}
    for a in attempts:
        by_job.setdefault(a["job_id"], []).append((a["start"], a["end"] or time.time()))
    assert all(max_overlap(spans) == 1 for spans in by_job.values()), by_job


def test_periodic_sandbox_fires_once_per_interval_across_three_daemons(
    tmp_path: Path, pg_dsn: str
) -> None:
    """Fires are counted where they happen (each daemon's ``schedule_fires`` metric counts
    the runs it won, reconciled ones too), not by the job rows they leave: a fire while the
    previous pull still runs reconciles into it and adds no row, so rows alone would not
    show three daemons that each fired on their own."""
    make_tree(tmp_path / "ws", seed=3)
    interval = 2.0
    box = f"""
[sandboxes.tick]
uri = "local:{tmp_path}/ws"
dest = "{tmp_path}/roots/tick"
interval = {interval}
jitter = 0
"""
    query = "SELECT created_at FROM wsync_jobs WHERE trigger = 'schedule' ORDER BY created_at"
    fires = "wsync_fleet_schedule_fires_total"
    with fleet(tmp_path, pg_dsn, box) as group:
        daemons = group.add_many(3)
        all_up = time.time()
        group.daemons[0].wait_until(
            lambda: len([r for r in group.sql(query) if float(r[0]) >= all_up]) >= 3,
            timeout=90,
            what="three scheduled pulls with three daemons up",
        )
        time.sleep(2 * interval)  # a few more intervals with everyone firing, if they would
        fired = [metric(d, fires) for d in daemons]
        until = time.time()
        times = [float(r[0]) for r in group.sql(query)]
        (schedules,) = group.sql("SELECT count(*) FROM wsync_schedule")[0]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # the first fire made the first row; each later one needs next_at, which the winner set
    # a full interval ahead, to come round again, so this bound holds however slow the
    # machine is (a slow machine only fires less); three daemons firing alone make ~3x
    most = int((until - times[0]) / interval) + 1
    print(f"schedule fires per daemon {fired}, at most {most} allowed, job gaps {gaps}")
    assert 3 <= sum(fired) <= most, (fired, most)
    assert schedules == 1
    # half an interval leaves room for a loaded machine's scheduling delays
    assert all(gap >= 1.0 for gap in gaps), gaps


def test_a_refused_schedule_does_not_stop_the_others(tmp_path: Path, pg_dsn: str) -> None:
    """Sandbox ``a``'s DEST becomes a symlink out of the root: its scheduled pulls are
    refused, once an interval, and ``b``'s (sorted after it) go on.  The due sandboxes were
    fired in one loop under one ``except``: ``a``'s refusal ended the loop before ``b`` at
    every poll, and ``a`` stayed due (found by an independent review)."""
    make_tree(tmp_path / "ws", seed=5)
    (tmp_path / "outside").mkdir()
    box = "".join(
        f'[sandboxes.{name}]\nuri = "local:{tmp_path}/ws"\ndest = "{tmp_path}/roots/{name}"\n'
        "interval = 1\njitter = 0\n"
        for name in ("a", "b")
    )
    count = "SELECT count(*) FROM wsync_jobs WHERE sandbox = %s"
    with fleet(tmp_path, pg_dsn, box) as group:
        daemon = group.add()
        done = count + " AND state = 'succeeded'"
        daemon.wait_until(lambda: group.sql(done, "a")[0][0] >= 1, timeout=60, what="a pulled")
        (tmp_path / "roots" / "a").rename(tmp_path / "a-was")
        (tmp_path / "roots" / "a").symlink_to(tmp_path / "outside")
        since = time.monotonic()
        daemon.wait_until(lambda: "schedule.refused" in daemon.log(), timeout=60, what="refusal")
        before = group.sql(count, "b")[0][0]
        daemon.wait_until(
            lambda: group.sql(count, "b")[0][0] >= before + 2, timeout=60, what="b pulled on"
        )
        refusals = daemon.log().count("schedule.refused")
        elapsed = time.monotonic() - since
    assert list((tmp_path / "outside").iterdir()) == []
    # one refusal an interval (1 s), not one a poll (4 a second)
    assert refusals <= elapsed + 2, (refusals, elapsed)


def test_a_reload_tries_a_refused_schedule_again_at_once(tmp_path: Path, pg_dsn: str) -> None:
    """A refused schedule waits its interval (at most a minute) before it is tried again;
    a reload, which may have mended it, clears that wait (a daily sandbox would otherwise
    have waited a day after its DEST was fixed; found by a review)."""
    make_tree(tmp_path / "ws", seed=6)
    (tmp_path / "outside").mkdir()
    dest = tmp_path / "roots" / "a"
    box = (
        f'[sandboxes.a]\nuri = "local:{tmp_path}/ws"\ndest = "{dest}"\n'
        "interval = 3600\njitter = 0\n"
    )
    count = "SELECT count(*) FROM wsync_jobs WHERE sandbox = 'a' AND state = 'succeeded'"
    due = "UPDATE wsync_schedule SET next_at = now() WHERE sandbox = 'a' RETURNING sandbox"
    with fleet(tmp_path, pg_dsn, box) as group:
        daemon = group.add()
        daemon.wait_until(lambda: group.sql(count)[0][0] == 1, timeout=60, what="a pulled")
        dest.rename(tmp_path / "a-was")
        dest.symlink_to(tmp_path / "outside")
        group.sql(due)
        daemon.wait_until(lambda: "schedule.refused" in daemon.log(), timeout=60, what="refusal")
        dest.unlink()  # mended, and the config reloaded: due still, tried again at once
        daemon.signal(signal.SIGHUP)
        daemon.wait_until(lambda: group.sql(count)[0][0] == 2, timeout=30, what="a again")


def test_a_nul_byte_in_a_request_is_the_requests_error_not_the_stores(
    tmp_path: Path, pg_dsn: str
) -> None:
    """``/v1/pulls/%00`` reached PostgreSQL, whose refusal (no NUL in text) the daemon took
    for an outage: 503 ``store-unavailable``, a store error counted and ``/readyz`` 503
    (found by an independent review)."""
    with fleet(tmp_path, pg_dsn, f'[sandboxes.box]\nuri = "local:{tmp_path}/ws"\n') as group:
        daemon = group.add()
        daemon.wait_until(lambda: daemon.request("GET", "/readyz", token=None)[0] == 200)
        errors = metric(daemon, "wsync_fleet_store_errors_total")
        assert daemon.request("GET", "/v1/pulls/%00")[0] == 404
        assert daemon.request("DELETE", "/v1/pulls/a%00b")[0] == 404
        status, body = daemon.request("GET", "/v1/pulls?sandbox=%00")
        assert status == 422 and "NUL" in body["error"], body
        assert daemon.request("GET", "/readyz", token=None)[0] == 200
        assert metric(daemon, "wsync_fleet_store_errors_total") == errors


def test_any_daemon_answers_get_events_and_delete(tmp_path: Path, pg_dsn: str) -> None:
    with fleet(tmp_path, pg_dsn, big_sandbox(tmp_path), lease=5.0) as group:
        daemons = group.add_many(2)
        job = daemons[0].pull("big")
        _, _owner, other = running_at(group, job["id"], 4)
        seen = other.job(job["id"])
        assert seen["state"] == "running"
        # dedupe holds across the fleet: the same request at another daemon reconciles
        again = other.pull("big")
        assert again["id"] == job["id"] and again["reconciled"], again
        events = read_events(other, job["id"], want=2)
        assert any(e == "progress" for e, _ in events), events
        status, body = other.request("DELETE", f"/v1/pulls/{job['id']}")
        assert status == 202, body
        cancelled = other.wait_job(job["id"], ("cancelled",), timeout=30)
    assert cancelled["error_kind"] == "interrupted"
    assert not (tmp_path / "roots" / "big").exists()


def read_events(daemon: DaemonProcess, job_id: str, want: int) -> list[tuple[str, Any]]:
    host, _, port = daemon.address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    conn.request("GET", f"/v1/events?job={job_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    out: list[tuple[str, Any]] = []
    event = ""
    try:
        while len(out) < want:
            line = response.fp.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[len("data: ") :])))
    finally:
        conn.close()
    return out


# -- configuration and docs (no PostgreSQL needed) --------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_a_store_needs_a_shared_engine_dir_outside_the_dest_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsync.daemon.config import ConfigError, load_config

    monkeypatch.setenv("WSYNC_API_TOKEN", TOKEN)
    cfg = tmp_path / "c.toml"
    base = f'store = "postgresql://wsync@db/wsync"\ndest_roots = ["{tmp_path}/roots"]\n'
    cfg.write_text(base, encoding="utf-8")
    with pytest.raises(ConfigError, match="engine_dir: a PostgreSQL store"):
        load_config(cfg)
    # journals inside a dest root could be named as a DEST and replaced by a pull
    cfg.write_text(base + f'engine_dir = "{tmp_path}/roots/.engine"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="engine_dir: must lie outside every dest root"):
        load_config(cfg)
    cfg.write_text(base + 'engine_dir = "shared/engine"\n', encoding="utf-8")
    config = load_config(cfg)
    assert config.engine_state_dir == tmp_path / "shared" / "engine"
    assert config.pull_options(None).state_dir == tmp_path / "shared" / "engine"
    cfg.write_text('store = "mysql://x/y"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="store: must be a postgresql:// URL"):
        load_config(cfg)


def test_docs_fleet_compose_is_the_shipped_file_with_three_daemons_sharing_volumes() -> None:
    import yaml

    shipped = (REPO / "deploy" / "compose.fleet.yaml").read_text(encoding="utf-8")
    doc = (REPO / "docs" / "daemon.md").read_text(encoding="utf-8")
    assert f"```yaml\n{shipped}```" in doc, "docs/daemon.md must show deploy/compose.fleet.yaml"
    compose = yaml.safe_load(shipped)
    daemons = [name for name in compose["services"] if name.startswith("wsync")]
    assert len(daemons) == 3
    for name in daemons:
        service = compose["services"][name]
        env = service["environment"]
        assert env["WSYNC_STORE"].startswith("postgresql://") and "@postgres:" in env["WSYNC_STORE"]
        assert "workspaces:/workspaces" in service["volumes"]
        assert f"engine:{env['WSYNC_ENGINE_DIR']}" in service["volumes"]
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
    states = {v for n in daemons for v in compose["services"][n]["volumes"] if "state" in v}
    assert len(states) == 3, "each daemon needs its own state_dir"
    assert "/var/lib/wsync-engine" in (REPO / "deploy" / "Dockerfile").read_text(encoding="utf-8")
