"""``wsync pull ssh://...`` against a real OpenSSH sshd on loopback, clean and under faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, pids_with
from wsync.testing.sshd import SshdServer

pytestmark = pytest.mark.ssh


def wsync(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def ssh_args(server: SshdServer) -> list[str]:
    opts = server.transport_options()
    return ["--ssh-key", str(opts["ssh_key"]), "--known-hosts", str(opts["known_hosts"])]


#: every fault at random, and the second call's head lost for sure: a first pull makes
#: about 14 calls now, and in one CI run none of seed 9's draws cost a retry
@pytest.mark.parametrize("client", ["asyncssh", "openssh"])
@pytest.mark.parametrize("chaos", [None, "all,seed=9,hang=0.2,map=.H"])
def test_pull_over_ssh_is_exact(
    tmp_path: Path, sshd: SshdServer, chaos: str | None, client: str
) -> None:
    ws = make_tree(tmp_path / "ws", big=2 * 1024 * 1024)
    dest = tmp_path / "out"
    extra = ["--chaos", chaos] if chaos else []
    extra += ["--ssh-client", client]
    proc = wsync(
        "pull",
        sshd.uri(str(ws)),
        str(dest),
        "--json",
        "--chunk-size",
        "512K",
        "--state-dir",
        str(tmp_path / "state"),
        "--staging-dir",
        str(tmp_path / "staging"),
        *ssh_args(sshd),
        *extra,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"] and result["chunks"] >= 4
    assert_exact(ws, dest)
    if chaos:
        assert result["retries"] > 0


@pytest.mark.parametrize("client", ["asyncssh", "openssh"])
def test_unknown_host_key_is_refused_by_default(
    tmp_path: Path, sshd: SshdServer, client: str
) -> None:
    ws = make_tree(tmp_path / "ws", big=1024)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    key = str(sshd.transport_options()["ssh_key"])
    proc = wsync(
        "pull",
        sshd.uri(str(ws)),
        str(tmp_path / "out"),
        "--ssh-key",
        key,
        "--known-hosts",
        str(empty),
        "--state-dir",
        str(tmp_path / "state"),
        "--ssh-client",
        client,
    )
    assert proc.returncode == 3
    assert "host key" in proc.stderr.lower()
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_small_pull_over_ssh_is_one_exec_and_exec_per_call_still_works(
    tmp_path: Path, sshd: SshdServer
) -> None:
    """One guest helper answers every call over one channel; ``--exec-per-call`` is the
    old way, and both give the same exact tree."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "small.txt").write_text("one small file\n")
    execs = {}
    for how in ("helper", "exec-per-call", "openssh"):
        dest = tmp_path / how
        extra = {"exec-per-call": ["--exec-per-call"], "openssh": ["--ssh-client", "openssh"]}
        extra = extra.get(how, [])
        proc = wsync(
            "pull", sshd.uri(str(ws)), str(dest), "--json",
            "--state-dir", str(tmp_path / f"{how}-state"),
            "--staging-dir", str(tmp_path / f"{how}-staging"),
            *ssh_args(sshd), *extra,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["retries"] == 0, result["faults"]
        assert_exact(ws, dest)
        execs[how] = result["execs"]
    # one helper; a second when a status long poll runs beside the first read (the
    # producer still writing when the first status answered: a loaded machine)
    assert execs["helper"] <= 2 and execs["openssh"] <= 2
    # the probe, the producer's install, the listing's and the archive's admissions (each
    # carries its small stream whole and removes its staging: no read, no cleanup)
    assert execs["exec-per-call"] >= 5
    # and no helper outlives its pull in the guest (this server's sessions only)
    assert sshd.session_home is not None
    home = f"HOME={sshd.session_home}"
    deadline = time.monotonic() + 20
    while (left := pids_with(home, "wsync-helper")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []
