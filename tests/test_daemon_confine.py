"""The daemon stays inside its roots at the time of the write (issue 7, items 2-4).

Destinations are confined again just before a job runs, walking from the root
without following symlinks; ``local:`` sources in requests are off unless
``api.local_roots`` allows them; a short ``WSYNC_API_TOKEN`` is refused like a
short token file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_daemon_harness import TOKEN, DaemonProcess, base_config, make_tree, running
from wsync.daemon.config import DestForbidden, check_dest
from wsync.daemon.confine import (
    Forbidden,
    check_local_source,
    confine_dest,
    confine_source,
    local_reader,
)
from wsync.errors import UsageError
from wsync.transports.base import ExecResult
from wsync.transports.local import LocalTransport

# -- the confinement walk itself, on real directories -----------------------


def test_confine_dest_creates_parents_and_refuses_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    dest = root / "a" / "b" / "dest"
    assert confine_dest(dest, [root]) == root  # a missing root is created, as configured
    assert (root / "a" / "b").is_dir() and not dest.exists()

    # a directory on the way swapped for a symlink that points outside
    (root / "a").rename(tmp_path / "old-a")
    (root / "a").symlink_to(outside)
    with pytest.raises(Forbidden, match=r"a is a symlink or not a directory now"):
        confine_dest(root / "a" / "new" / "dest", [root])
    assert list(outside.iterdir()) == [], "nothing was created through the symlink"

    # DEST itself a symlink; a root that is no longer configured
    (root / "c").mkdir()
    (root / "c" / "dest").symlink_to(outside)
    with pytest.raises(Forbidden, match=r"dest .* is a symlink now"):
        confine_dest(root / "c" / "dest", [root])
    with pytest.raises(Forbidden, match="no longer inside the allowed roots"):
        confine_dest(root / "c" / "x", [tmp_path / "elsewhere"])
    with pytest.raises(Forbidden, match="no longer inside"):
        confine_dest(root, [root])  # the root itself is never a DEST


def test_local_sources_need_a_local_root_and_no_symlink_below_it(tmp_path: Path) -> None:
    root = tmp_path / "sources"
    (root / "ws").mkdir(parents=True)
    with pytest.raises(Forbidden, match="local: sources are disabled"):
        check_local_source(root / "ws", [])
    with pytest.raises(Forbidden, match=r"outside api\.local_roots"):
        check_local_source(Path("/etc"), [root])
    (root / "to-etc").symlink_to("/etc")
    with pytest.raises(Forbidden, match=r"outside api\.local_roots"):
        check_local_source(root / "to-etc", [root])
    assert check_local_source(root / "ws", [root]) == root / "ws"
    confine_source(root / "ws", [root])
    (root / "ws").rename(root / "ws-old")
    (root / "ws").symlink_to("/etc")
    with pytest.raises(Forbidden, match="symlink or not a directory now"):
        confine_source(root / "ws", [root])


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user: needs root")
def test_a_local_source_another_user_could_swap_is_refused(tmp_path: Path) -> None:
    """Found by a review: whoever may rename a source's last component (write the directory
    holding it) can swap it for a symlink between the run-time check and the guest's
    ``cd`` and have the daemon copy what it alone may read (its API token) into DEST.
    Each directory from the root down to the source's parent must be the daemon user's
    or root's and writable by nobody else; the source itself may be anyone's."""
    root = tmp_path / "sources"
    agent = root / "agents" / "alice"
    (agent / "ws").mkdir(parents=True)
    os.chown(agent / "ws", 65534, 65534)  # the agent's own workspace: fine
    confine_source(agent / "ws", [root])
    confine_source(root, [root])  # a root itself is the operator's word
    os.chown(agent, 65534, 65534)  # the agent owns the directory holding it
    with pytest.raises(Forbidden, match=r"alice \(uid 65534.*another user"):
        confine_source(agent / "ws", [root])
    os.chown(agent, 0, 0)
    (root / "agents").chmod(0o777)  # anyone may rename alice
    with pytest.raises(Forbidden, match=r"agents \(uid 0, mode 777\)"):
        confine_source(agent / "ws", [root])
    (root / "agents").chmod(0o755)
    root.chmod(0o775)  # the group may rename agents
    with pytest.raises(Forbidden, match="may be changed by another user"):
        confine_source(agent / "ws", [root])
    root.chmod(0o755)
    confine_source(agent / "ws", [root])


# -- through the daemon ------------------------------------------------------


def test_symlink_swapped_into_dest_parent_before_the_job_runs(tmp_path: Path) -> None:
    """Accepted while DEST's parent is a real directory; run after it became a symlink.

    A second job, accepted into a second root, runs after a reload dropped
    that root: the roots of the moment the job runs decide, not the old ones.
    """
    make_tree(tmp_path / "ws", seed=21)
    make_tree(tmp_path / "ws-slow", seed=22, big=24 * 1024 * 1024)
    roots, outside, dropped = tmp_path / "roots", tmp_path / "outside", tmp_path / "dropped"
    (roots / "sub").mkdir(parents=True)
    outside.mkdir()
    dropped.mkdir()
    config = base_config(
        tmp_path,
        f"""
[sandboxes.ws]
uri = "local:{tmp_path}/ws"

[sandboxes.slow]
uri = "local:{tmp_path}/ws-slow"
dest = "{roots}/slow"
parallel = 1
""",
        max_concurrent=1,
    )
    two_roots = config.replace(
        f'dest_roots = ["{roots}"]', f'dest_roots = ["{roots}", "{dropped}"]'
    )
    with running(tmp_path, two_roots) as daemon:
        slow = daemon.pull("slow")
        daemon.wait_until(
            lambda: daemon.job(slow["id"])["state"] == "running", what="the slow pull to run"
        )
        job = daemon.pull("ws", f"{roots}/sub/x")  # accepted: roots/sub is a directory
        later = daemon.pull("ws", f"{dropped}/y")  # accepted: dropped is a root for now
        assert daemon.job(job["id"])["state"] == "queued"
        (roots / "sub").rename(tmp_path / "sub-was")
        (roots / "sub").symlink_to(outside)
        daemon.config_path.write_text(config, encoding="utf-8")
        assert daemon.request("POST", "/v1/reload")[0] == 200
        status, _ = daemon.request("DELETE", f"/v1/pulls/{slow['id']}")
        assert status == 202
        final = daemon.wait_job(job["id"], ("failed", "succeeded"), timeout=60)
        second = daemon.wait_job(later["id"], ("failed", "succeeded"), timeout=60)
    assert final["state"] == "failed", final
    assert final["error_kind"] == "forbidden" and final["exit_code"] == 2, final
    assert "symlink" in final["error"] and f"{roots}/sub" in final["error"], final
    assert list(outside.iterdir()) == [], "nothing may be written outside the dest roots"
    assert second["state"] == "failed" and second["error_kind"] == "forbidden", second
    assert "no longer inside the allowed roots" in second["error"], second
    assert list(dropped.iterdir()) == []


def _post(daemon: DaemonProcess, sandbox: str, dest: str) -> tuple[int, dict[str, str]]:
    status, body = daemon.request("POST", "/v1/pulls", {"sandbox": sandbox, "dest": dest})
    return status, body


def test_local_sources_through_the_api_are_off_by_default(tmp_path: Path) -> None:
    secrets = tmp_path / "etc-wsync"
    secrets.mkdir()
    (secrets / "api-token").write_text(TOKEN, encoding="utf-8")
    make_tree(tmp_path / "allowed" / "ws", seed=23)
    (tmp_path / "roots").mkdir()
    dest = f"{tmp_path}/roots/copy"
    default = base_config(tmp_path)
    with running(tmp_path, default) as daemon:
        status, body = _post(daemon, f"local:{secrets}", dest)
        assert status == 403 and body["kind"] == "forbidden", body
        assert "api.allow_uris" in body["error"], body

        uris_on = base_config(tmp_path, api="allow_uris = true")
        daemon.config_path.write_text(uris_on, encoding="utf-8")
        assert daemon.request("POST", "/v1/reload")[0] == 200
        status, body = _post(daemon, f"local:{secrets}", dest)
        assert status == 403 and "local: sources are disabled" in body["error"], body
        assert "api.local_roots" in body["error"], body

        with_root = base_config(
            tmp_path, api=f'allow_uris = true\nlocal_roots = ["{tmp_path}/allowed"]'
        )
        daemon.config_path.write_text(with_root, encoding="utf-8")
        assert daemon.request("POST", "/v1/reload")[0] == 200
        status, body = _post(daemon, f"local:{secrets}", dest)
        assert status == 403 and "outside api.local_roots" in body["error"], body
        status, job = _post(daemon, f"local:{tmp_path}/allowed/ws", dest)
        assert status == 202, job
        done = daemon.wait_job(job["id"])
        assert done["result"]["ok"] is True
    assert not (tmp_path / "roots" / "copy" / "api-token").exists()


def test_short_api_token_from_the_environment_is_refused_like_a_short_file(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(base_config(tmp_path), encoding="utf-8")
    env = {**os.environ, "WSYNC_API_TOKEN": "short-token"}
    result = subprocess.run(
        [sys.executable, "-m", "wsync.daemon", "--config", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "WSYNC_API_TOKEN: the token must be at least 16 characters" in result.stderr
    assert "short-token" not in result.stderr and "Traceback" not in result.stderr


def test_status_refuses_a_token_with_a_line_break_without_echoing_it(tmp_path: Path) -> None:
    """A two-line token file made http.client raise with the token in the traceback."""
    import subprocess
    import sys

    token_file = tmp_path / "token"
    token_file.write_text("SECRET-first-line-xxxx\nsecond-line-yyyy\n")
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", "status", "--url", "http://127.0.0.1:9",
         "--token-file", str(token_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "SECRET" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_a_plain_token_in_sandbox_options_is_refused(tmp_path: Path) -> None:
    """Tokens are secrets by reference; a pasted one in ``options`` bypassed redaction."""
    import pydantic

    from wsync.daemon.config import SandboxConfig, format_validation_error

    with pytest.raises(pydantic.ValidationError, match="by reference") as info:
        SandboxConfig(uri="e2b://sbx/work", options={"e2b_token": "pasted-secret-value"})
    shown = format_validation_error(info.value)  # what the daemon prints
    assert "by reference" in shown and "pasted-secret-value" not in shown


def test_a_dest_over_the_daemons_own_state_is_refused(tmp_path: Path) -> None:
    """``dest_roots = ["~"]`` with the state directory under it is an ordinary setup; a
    request naming the state (or a directory in it, or one holding it) as DEST would have
    the pull replace the journals and the job store with what the guest sent."""
    make_tree(tmp_path / "allowed" / "ws", seed=29)
    roots = tmp_path / "roots"
    roots.mkdir()
    config = base_config(
        tmp_path, api=f'allow_uris = true\nlocal_roots = ["{tmp_path}/allowed"]'
    ).replace(f'state_dir = "{tmp_path}/state"', f'state_dir = "{roots}/.state"')
    source = f"local:{tmp_path}/allowed/ws"
    daemon = DaemonProcess(tmp_path, config)
    daemon.state_dir = roots / ".state"
    with contextlib.closing(daemon.start()):
        for dest in (".state/engine/pulls", ".state", ".state/engine", ".state/x/y"):
            status, body = _post(daemon, source, f"{roots}/{dest}")
            assert status == 403 and "state directory" in body["error"], (dest, body)
        status, job = _post(daemon, source, f"{roots}/copy")  # beside it: fine
        assert status == 202, job
        assert daemon.wait_job(job["id"])["result"]["ok"] is True
    state = roots / ".state"
    assert not list(state.rglob("blob.bin"))  # no file of the guest's tree in the state


def test_a_configured_dest_over_the_state_is_a_config_error(tmp_path: Path) -> None:
    from wsync.daemon.config import check_dest

    roots = tmp_path / "roots"
    state = roots / "st"
    for dest in (state, state / "engine", roots):
        with pytest.raises(Forbidden, match="state directory"):
            check_dest(str(dest), [tmp_path], (state,))
    assert check_dest(str(roots / "other"), [tmp_path], (state,)) == roots / "other"


def test_a_dest_below_a_reserved_name_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    """wsync keeps ``.NAME.wsync-lock`` (and -prev, -old, -tmp-*) beside a DEST: a request
    for ``ROOT/.a.wsync-lock/x`` used to be accepted and its parents made at run time before
    the engine refused the name, leaving a directory where the pulls of ``ROOT/a`` take
    their lock (each failed with EISDIR from then on; found by an independent review)."""
    roots = tmp_path / "roots"
    for name in (".a.wsync-lock", ".a.wsync-prev", ".a.wsync-old", ".a.wsync-tmp-0123456789ab"):
        with pytest.raises(UsageError, match="wsync's own"):
            check_dest(str(roots / name / "x"), [roots])
        with pytest.raises(UsageError, match="wsync's own"):
            confine_dest(roots / name / "x", [roots])
    assert not roots.exists()  # confine_dest made nothing, not even the root
    roots.mkdir()
    (roots / "link").symlink_to(roots / ".a.wsync-lock")  # a link in a root names one
    with pytest.raises(UsageError, match="wsync's own"):
        check_dest(str(roots / "link" / "x"), [roots])
    assert sorted(p.name for p in roots.iterdir()) == ["link"]

    make_tree(tmp_path / "ws", seed=31)
    extra = f'[sandboxes.a]\nuri = "local:{tmp_path}/ws"\ndest = "{roots}/a"\n'
    with running(tmp_path, base_config(tmp_path, extra)) as daemon:
        status, body = daemon.request(
            "POST", "/v1/pulls", {"sandbox": "a", "dest": f"{roots}/.a.wsync-lock/x"}
        )
        assert status == 422 and "wsync's own" in body["error"], body
        assert not (roots / ".a.wsync-lock").exists()
        assert daemon.wait_job(daemon.pull("a")["id"])["exit_code"] == 0


def test_a_dest_in_a_symlink_loop_is_forbidden_not_a_crash(tmp_path: Path) -> None:
    """Resolving a DEST through a symlink loop raised RuntimeError, which nothing caught:
    a scheduler's task died (in a fleet, every schedule's) and a request got a bare 500
    (found by a review)."""
    roots = tmp_path / "roots"
    roots.mkdir()
    (roots / "loop").symlink_to(roots / "loop")
    with pytest.raises(DestForbidden, match="cannot be resolved"):
        check_dest(str(roots / "loop" / "x"), [roots])


def test_a_dest_resolving_to_a_name_not_utf8_is_forbidden_not_a_crash(tmp_path: Path) -> None:
    """A link in a root leading to a name that is not UTF-8: no job store holds it exactly,
    and the store's UnicodeEncodeError was a bare 500 and the end of a schedule (found by
    a review)."""
    roots = tmp_path / "roots"
    roots.mkdir()
    odd = os.fsdecode(bytes(roots) + b"/odd-\xff")
    os.mkdir(odd)
    (roots / "link").symlink_to(odd)
    with pytest.raises(DestForbidden, match="not UTF-8"):
        check_dest(str(roots / "link" / "x"), [roots])


# -- a source another user owns is read as that user -------------------------


def _nobody_workspace() -> Path:
    """A workspace nobody owns, under a root-owned directory nobody may search (pytest's
    own tmp dirs are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="wsync-agent-"))
    base.chmod(0o755)
    ws = base / "agents" / "ws"
    ws.mkdir(parents=True)
    for d in (base / "agents", ws):
        d.chmod(0o755)
    (ws / "notes.txt").write_text("the agent's\n", encoding="utf-8")
    for p in (ws, ws / "notes.txt"):
        os.chown(p, 65534, 65534)
    return ws


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play a daemon that switches users")
def test_a_local_source_another_user_owns_is_read_as_that_user(tmp_path: Path) -> None:
    """Found by a red-team review: ``tar`` opens a select run's names by path, so an agent
    that owns its workspace could swap one of its directories for a symlink between the
    listing and the read and have the daemon (root) copy what only root may read into
    DEST.  The guest side now runs as the workspace's owner: a file in it that only root
    may read cannot be read by the pull, and once it is gone the pull is exact."""
    ws = _nobody_workspace()
    try:
        # the workspace's group is root's (made by root, then chown'ed to its agent): the
        # pull runs in the owner's own group, never the directory's (found by a review)
        os.chown(ws, 65534, 0)
        secret = ws / "root-only.txt"
        secret.write_text("only root and its group may read this\n", encoding="utf-8")
        secret.chmod(0o640)
        (tmp_path / "roots").mkdir()
        dest = tmp_path / "roots" / "copy"
        config = base_config(tmp_path, api=f'allow_uris = true\nlocal_roots = ["{ws}"]')
        with running(tmp_path, config) as daemon:
            status, job = _post(daemon, f"local:{ws}", str(dest))
            assert status == 202, job
            done = daemon.wait_job(job["id"], states=("failed",))
            assert "Permission denied" in done["error"], done
            assert not dest.exists()
            secret.unlink()
            status, job = _post(daemon, f"local:{ws}", str(dest))
            assert status == 202, job
            assert daemon.wait_job(job["id"])["result"]["ok"] is True
        assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    finally:
        shutil.rmtree(ws.parent.parent)


def test_a_local_reader_runs_as_the_owner_with_a_fresh_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner may read its processes' ``/proc/PID/environ``: none of the daemon's
    variables (its token, a DSN) reach the guest side, and it runs in ``/``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch users")
    monkeypatch.setenv("WSYNC_API_TOKEN", "a-secret-of-the-daemon")

    async def main() -> ExecResult:
        transport = LocalTransport(run_as=(65534, 65534))
        return await transport.exec(
            ["sh", "-c", 'id -u; id -g; pwd; echo "$HOME"; cat /proc/self/environ'], timeout=20
        )

    result = asyncio.run(main())
    lines = result.stdout.split(b"\n", 4)
    assert lines[:3] == [b"65534", b"65534", b"/"], result
    assert lines[3] == os.fsencode(pwd.getpwuid(65534).pw_dir), result
    assert b"a-secret-of-the-daemon" not in result.stdout
    assert not LocalTransport(run_as=(65534, 65534), file_api=True).capabilities.file_read


def test_a_daemon_that_cannot_switch_users_refuses_another_users_source(tmp_path: Path) -> None:
    """Run as nobody, a requested source that uid 4242 owns is refused (the daemon would
    read it with its own rights); a configured one is the operator's choice."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns and to run as nobody")
    ws = _nobody_workspace()
    try:
        os.chown(ws, 4242, 4242)
        code = (
            "import sys; from pathlib import Path\n"
            "from wsync.daemon.confine import Forbidden, local_reader\n"
            f"assert local_reader(Path({str(ws)!r}), requested=False) is None\n"
            f"try: local_reader(Path({str(ws)!r}), requested=True)\n"
            "except Forbidden as e: print(e)\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
            capture_output=True, text=True, env=env, check=True, timeout=60, cwd="/",
        )  # fmt: skip
        assert "belongs to uid 4242" in out.stdout and "run as root" in out.stdout, out
    finally:
        shutil.rmtree(ws.parent.parent)


def test_with_nested_roots_a_root_or_a_dest_holding_one_is_refused(tmp_path: Path) -> None:
    """Found by a red-team review: with ``dest_roots = [ws, ws/team]``, DEST ``ws/team``
    lies inside the other root and was accepted at request and at run time; one pull
    would then replace the whole ``team`` root, every other DEST in it included."""
    outer, inner = tmp_path / "ws", tmp_path / "ws" / "team"
    inner.mkdir(parents=True)
    roots = [outer, inner]
    for dest in (inner, inner.parent / "team", tmp_path / "ws"):
        with pytest.raises(DestForbidden, match="is a dest root itself, or holds one"):
            check_dest(str(dest), roots)
        with pytest.raises(Forbidden, match="no longer inside"):
            confine_dest(dest, roots)
    deeper = tmp_path / "ws" / "team" / "job1"
    assert check_dest(str(deeper), roots) == deeper
    assert confine_dest(deeper, roots) in (outer, inner)
    assert check_dest(str(tmp_path / "ws" / "other"), roots) == tmp_path / "ws" / "other"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a source another user owns")
def test_the_reader_of_a_source_is_its_owner_in_the_owners_group_through_a_link(
    tmp_path: Path,
) -> None:
    """The gid is the owner's passwd group (nogroup without an entry), not the source
    directory's; a configured source that is a symlink is read as its target's owner."""
    ws = _nobody_workspace()
    try:
        os.chown(ws, 65534, 0)
        nobody_gid = pwd.getpwuid(65534).pw_gid
        assert local_reader(ws, requested=True) == (65534, nobody_gid)
        link = tmp_path / "link"
        link.symlink_to(ws)
        assert local_reader(link, requested=False) == (65534, nobody_gid)
        os.chown(ws, 4242, 0)  # no passwd entry
        assert local_reader(ws, requested=True) == (4242, 65534)
        os.chown(ws, 0, 0)
        assert local_reader(ws, requested=True) is None
    finally:
        shutil.rmtree(ws.parent.parent)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make directories others own")
def test_a_source_someone_else_could_swap_is_read_as_them_or_refused(tmp_path: Path) -> None:
    """Found by a review of 38147e4: a configured source in a directory its agent owns,
    swapped for a symlink to root's files, was judged by the link's target (root's) and
    read as root; a missing one was read as the daemon (the agent could make it after the
    look).  Whoever could put something there decides now."""
    ws = _nobody_workspace()
    agent = ws.parent  # root's, 755: made nobody's below
    try:
        nobody = (65534, pwd.getpwuid(65534).pw_gid)
        os.chown(agent, 65534, 65534)
        shutil.rmtree(ws)
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        ws.symlink_to(private)  # root made the link, in the agent's directory
        assert local_reader(ws, requested=False) == nobody
        os.chown(ws, 65534, 65534, follow_symlinks=False)
        assert local_reader(ws, requested=False) == nobody
        ws.unlink()
        assert local_reader(ws, requested=False) == nobody  # missing: the agent may make it
        os.chown(agent, 0, 0)
        assert local_reader(ws, requested=False) is None  # missing, and only root may make it
        ws.mkdir()
        agent.chmod(0o775)  # the group may swap it
        with pytest.raises(Forbidden, match="may be changed by other users"):
            local_reader(ws, requested=False)
        agent.chmod(0o1777)  # like /tmp: nobody else may rename root's entry
        assert local_reader(ws, requested=False) is None
    finally:
        shutil.rmtree(agent.parent)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make directories others own")
def test_the_source_path_is_walked_as_the_kernel_resolves_it(tmp_path: Path) -> None:
    """Found by a third review: a relative link target's '..' was taken from the link's
    path, not from the real directory holding it; only the directory holding the source
    was looked at, not those above it; a source missing from a sticky directory anyone
    may write to was read as the daemon; a chain of 8 links was refused."""
    nobody = (65534, pwd.getpwuid(65534).pw_gid)
    home = tmp_path / "data" / "home"
    (home / "links").mkdir(parents=True)
    (home / "agent" / "ws").mkdir(parents=True)
    for d in (home / "agent", home / "agent" / "ws"):
        os.chown(d, 65534, 65534)
    (tmp_path / "srv").symlink_to(home / "links")
    (home / "links" / "alice").symlink_to("../agent/ws")  # root's link, a relative target
    assert local_reader(tmp_path / "srv" / "alice", requested=False) == nobody
    # an agent's directory above a root-owned holder: the agent could swap the holder
    (home / "agent" / "projects" / "ws").mkdir(parents=True)
    assert local_reader(home / "agent" / "projects" / "ws", requested=False) == nobody
    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with pytest.raises(Forbidden, match="anyone may make it"):
        local_reader(sticky / "agent-ws", requested=False)
    chain = tmp_path / "chain0"
    (tmp_path / "chain8").mkdir()
    for i in range(8):
        (tmp_path / f"chain{i}").symlink_to(f"chain{i + 1}")
    assert local_reader(chain, requested=False) is None
    # (a fourth review: "~" and relative paths are the guest shell's to resolve; a source
    # others may write to is read whole, whatever they put in it)
    with pytest.raises(Forbidden, match="give an absolute path"):
        local_reader(Path("~/ws"), requested=False)
    assert local_reader(tmp_path / ("x" * 300), requested=False) is None  # (no such name)
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o1777)
    with pytest.raises(Forbidden, match="other users may write to it"):
        local_reader(tmp_path / "open", requested=False)
