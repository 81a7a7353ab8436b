"""``wsync pull k8s://NAMESPACE/POD/PATH`` through the engine, against the lossy API server.

The invariant everywhere: an exact tree, or a clear :class:`WsyncError` with DEST
untouched — never a wrong tree.  The naive-client test shows what the same faults do to a
plain ``tar`` over one exec: a wrong archive behind a Success status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_exact, make_tree, options
from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull_uri
from wsync.errors import IntegrityFailed, WsyncError
from wsync.transports.registry import open_transport
from wsync.treediff import snapshot

KiB = 1024
MiB = 1024 * KiB
FAULT_STATS = (
    "tail_dropped",
    "early_success",
    "bad_exit",
    "internal_error",
    "no_status",
    "stalls",
    "severed",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEmulatorThread]:
    with K8sEmulatorThread(tmp_path_factory.mktemp("k8s")) as emu:
        yield emu


def pod_workspace(emu: K8sEmulatorThread, pod: str) -> Path:
    ws = emu.create_pod(pod) / "work"
    ws.mkdir()
    return ws


def pull_pod(
    emu: K8sEmulatorThread, pod: str, ws: Path, dest: Path, opts: PullOptions
) -> PullResult:
    return asyncio.run(pull_uri(f"k8s://default/{pod}{ws}", dest, opts, emu.transport_options()))


def faults_fired(emu: K8sEmulatorThread) -> dict[str, int]:
    return {k: emu.stats[k] for k in FAULT_STATS if emu.stats[k]}


#: the faults an exec meets at the end of its stream and a helper's answers do not
EXEC_FAULTS = ("tail_dropped", "early_success", "bad_exit", "internal_error", "no_status")


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_small_workspace_is_exact_with_every_fault_on(
    cluster: K8sEmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    pod = f"small-{str(helpers).lower()}"
    ws = make_tree(pod_workspace(cluster, pod) / "t", big=300 * KiB, small=20)
    faults = K8sFaults.all_on(seed=11)
    if helpers:
        # a pull through helpers is two or three execs: the lost tail drawn for each of
        # them, so the faults a channel meets surely happen
        faults = dataclasses.replace(faults, drop_tail=1.0)
    cluster.set_faults(faults)
    before = dict(cluster.stats)
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=128 * KiB, helpers=helpers)
    result = pull_pod(cluster, pod, ws, dest, opts)
    assert result.ok
    assert_exact(ws, dest)
    hit = {k: cluster.stats[k] - before.get(k, 0) for k in (*FAULT_STATS, "tail_released")}
    if helpers:
        assert hit["tail_released"] > 0, hit  # answers held back as tails, then let go
    else:
        assert sum(hit[k] for k in EXEC_FAULTS) > 0, hit  # the exec path's own faults


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_multi_mb_workspace_is_exact_with_every_fault_on(
    cluster: K8sEmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    pod = f"big-{str(helpers).lower()}"
    ws = make_tree(pod_workspace(cluster, pod) / "t", big=5 * MiB, small=40)
    (ws / "more-random.bin").write_bytes(os.urandom(3 * MiB))
    cluster.set_faults(K8sFaults.all_on(seed=12))
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=1 * MiB, parallel=4, helpers=helpers)
    result = pull_pod(cluster, pod, ws, dest, opts)
    assert_exact(ws, dest)
    assert result.chunks >= 3


def test_empty_workspace_is_an_empty_dest(cluster: K8sEmulatorThread, tmp_path: Path) -> None:
    ws = pod_workspace(cluster, "empty")
    cluster.set_faults(K8sFaults.all_on(seed=13))
    dest = tmp_path / "out"
    pull_pod(cluster, "empty", ws, dest, options(tmp_path))
    assert dest.is_dir()
    assert list(dest.iterdir()) == []


@pytest.mark.slow
def test_two_hundred_mb_workspace_is_exact_with_every_fault_on(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    """~200 MB: the size where ``kubectl cp`` loses its last 10-40 MB (kubectl#1361)."""
    ws = pod_workspace(cluster, "huge")
    (ws / "random.bin").write_bytes(os.urandom(120 * MiB))
    (ws / "zeros.bin").write_bytes(bytes(60 * MiB))
    make_tree(ws / "tree", big=8 * MiB, small=50)
    cluster.set_faults(K8sFaults.all_on(seed=14))
    dest = tmp_path / "out"
    pull_pod(cluster, "huge", ws, dest, options(tmp_path, parallel=4, timeout=1800))
    assert_exact(ws, dest)


def test_naive_tar_over_one_exec_is_wrong_behind_a_success_status(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    """The field's failure (kubectl#1361): one ``tar`` over one exec loses its tail and
    the Status still says Success.  wsync's pull through the same faults is exact."""
    ws = pod_workspace(cluster, "report")
    (ws / "data.bin").write_bytes(os.urandom(2 * MiB))
    (ws / "notes.txt").write_text("the end of the archive\n" * 100)
    cluster.set_faults(K8sFaults.tail_loss())

    async def naive() -> tuple[bytes, int | None]:
        _, transport = open_transport(f"k8s://default/report{ws}", cluster.transport_options())
        async with transport:
            result = await transport.exec(["tar", "-cf", "-", "-C", str(ws), "."], timeout=60)
            return result.stdout, result.exit_status

    received, status = asyncio.run(naive())
    assert status == 0  # "success"
    assert cluster.stats["tail_dropped"] >= 1
    broken = False
    try:
        with tarfile.open(fileobj=io.BytesIO(received)) as tf:
            tf.extractall(tmp_path / "naive", filter="data")
    except (tarfile.TarError, EOFError, OSError):
        broken = True
    if not broken:
        broken = snapshot(tmp_path / "naive") != snapshot(ws)
    assert broken  # 64 KiB is more than tar's end padding: member data is gone

    dest = tmp_path / "out"
    pull_pod(cluster, "report", ws, dest, options(tmp_path, chunk_size=256 * KiB))
    assert_exact(ws, dest)


def test_internal_error_for_every_success_still_gives_an_exact_tree(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    """InternalError for every command that succeeded: no exit status is ever known, and
    wsync does not need one — its envelopes carry the guest's own verdict.  (One exec per
    call: a guest helper's calls end with no status of their own to spoil)"""
    ws = make_tree(pod_workspace(cluster, "internal") / "t", big=100 * KiB, small=4)
    cluster.set_faults(K8sFaults(internal_error=1.0))
    before = cluster.stats["internal_error"]
    dest = tmp_path / "out"
    pull_pod(cluster, "internal", ws, dest, options(tmp_path, helpers=False))
    assert_exact(ws, dest)
    assert cluster.stats["internal_error"] > before


def test_a_server_that_always_loses_the_tail_fails_clearly_and_leaves_dest(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(pod_workspace(cluster, "lossy") / "t", big=10 * KiB, small=2)
    cluster.set_faults(K8sFaults(drop_tail=1.0, drop_tail_max=4 * KiB))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    # one exec per call: a guest helper's answers are not a tail, see the next test
    opts = options(tmp_path, max_attempts=3, force=True, call_timeout=10, helpers=False)
    with pytest.raises(IntegrityFailed):
        pull_pod(cluster, "lossy", ws, dest, opts)
    assert snapshot(dest) == before


def test_guest_helpers_answer_where_every_exec_loses_its_tail(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    """The same server, with guest helpers: each answers many calls over one exec kept
    open, and an answer is not the output a command ends with: the emulator held each
    answer's tail back and let it go once the helper was seen waiting for more."""
    ws = make_tree(pod_workspace(cluster, "lossy-helped") / "t", big=300 * KiB, small=20)
    cluster.set_faults(K8sFaults(drop_tail=1.0, drop_tail_max=4 * KiB))
    execs, released = cluster.stats["execs"], cluster.stats["tail_released"]
    dest = tmp_path / "out"
    result = pull_pod(cluster, "lossy-helped", ws, dest, options(tmp_path, call_timeout=10))
    assert_exact(ws, dest)
    assert result.retries == 0
    # a helper per call in flight (chunk reads side by side) and no exec call at all
    assert result.execs <= 4, result.execs
    assert cluster.stats["execs"] - execs <= result.execs + 1  # (+ the protocol's probe)
    assert cluster.stats["tail_released"] - released >= 5  # probe, admissions, reads...


@pytest.fixture(scope="module")
def prop_workspace(cluster: K8sEmulatorThread) -> Path:
    return make_tree(pod_workspace(cluster, "prop") / "t", big=200 * KiB, small=8)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**16),
    drop_tail=st.floats(0.0, 0.8),
    early=st.floats(0.0, 0.5),
    bad_exit=st.floats(0.0, 0.5),
    internal=st.floats(0.0, 0.5),
    no_status=st.floats(0.0, 0.4),
    sever=st.floats(0.0, 0.3),
    split=st.floats(0.0, 1.0),
    stall=st.floats(0.0, 0.2),
    helpers=st.booleans(),
)
def test_random_fault_schedules_never_produce_a_wrong_tree(
    tmp_path_factory: pytest.TempPathFactory,
    cluster: K8sEmulatorThread,
    prop_workspace: Path,
    seed: int,
    drop_tail: float,
    early: float,
    bad_exit: float,
    internal: float,
    no_status: float,
    sever: float,
    split: float,
    stall: float,
    helpers: bool,
) -> None:
    cluster.set_faults(
        K8sFaults(
            seed=seed,
            drop_tail=drop_tail,
            drop_tail_max=64 * KiB,
            early_success=early,
            bad_exit=bad_exit,
            internal_error=internal,
            no_status=no_status,
            sever=sever,
            sever_max_bytes=64 * KiB,
            split_frames=split,
            stall=stall,
            stall_seconds=0.2,
        )
    )
    tmp = tmp_path_factory.mktemp("prop")
    dest = tmp / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(
        tmp, chunk_size=64 * KiB, max_attempts=8, force=True, timeout=120, helpers=helpers
    )
    try:
        pull_pod(cluster, "prop", prop_workspace, dest, opts)
    except WsyncError:
        assert snapshot(dest) == before  # untouched
    else:
        assert_exact(prop_workspace, dest)
    shutil.rmtree(tmp, ignore_errors=True)


REAL = os.environ.get("WSYNC_REAL_K8S_URI", "")


@pytest.mark.skipif(
    not REAL,
    reason="opt-in: set WSYNC_REAL_K8S_URI=k8s://NS/POD/PATH (cluster from $KUBECONFIG, "
    "container from WSYNC_REAL_K8S_CONTAINER) to pull from a real cluster",
)
def test_a_real_cluster_pull_twice_gives_the_same_tree(tmp_path: Path) -> None:
    """Against a real pod: two pulls of a quiet workspace agree, and the second resumes
    nothing it should not (the tree is compared file by file)."""
    topts = {"container": os.environ.get("WSYNC_REAL_K8S_CONTAINER") or None}
    first, second = tmp_path / "one", tmp_path / "two"
    result = asyncio.run(pull_uri(REAL, first, options(tmp_path / "a"), topts))
    assert result.ok
    asyncio.run(pull_uri(REAL, second, options(tmp_path / "b"), topts))
    assert snapshot(first) == snapshot(second)
