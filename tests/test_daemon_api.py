"""The daemon's HTTP API, driven over loopback against one real daemon process.

One daemon serves the whole module (start-up costs a second); every test uses
its own sandbox or destination so the tests do not depend on their order.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_daemon_harness import (
    TOKEN,
    DaemonProcess,
    assert_same_tree,
    base_config,
    make_tree,
    tree_of,
)
from wsync.daemon.client import jobs_main, status_main


def _config(tmp: Path, extra: str = "") -> str:
    return base_config(
        tmp,
        f"""
[sandboxes.ws]
uri = "local:{tmp}/ws"
dest = "{tmp}/roots/ws"

[sandboxes.sched]
uri = "local:{tmp}/ws-sched"
dest = "{tmp}/roots/sched"
interval = 1.0
jitter = 0

[sandboxes.slow]
uri = "local:{tmp}/ws-slow"
dest = "{tmp}/roots/slow"
parallel = 1
secrets = {{ token = "env:WSYNC_TEST_SECRET" }}
{extra}
""",
        api=f'allow_uris = true\nlocal_roots = ["{tmp}"]',
        parallel=2,
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("daemon")
    (tmp / "roots").mkdir()
    make_tree(tmp / "ws", seed=1)
    make_tree(tmp / "ws-sched", seed=2)
    make_tree(tmp / "ws-slow", seed=3, big=12 * 1024 * 1024)
    env = {"WSYNC_TEST_SECRET": "sekrit-value-that-must-not-leak"}
    proc = DaemonProcess(tmp, _config(tmp), env)
    proc.start()
    try:
        yield proc
    finally:
        proc.signal(signal.SIGTERM)
        code = proc.wait_exit()
        proc.close()
        log = proc.log()
        assert code == 0, log
        assert "sekrit-value-that-must-not-leak" not in log
        assert TOKEN not in log


def test_on_demand_pull_lands_exact_tree(daemon: DaemonProcess) -> None:
    job = daemon.pull("ws")
    assert job["state"] in ("queued", "running") and job["reconciled"] is False
    done = daemon.wait_job(job["id"])
    assert_same_tree(daemon.root / "ws", daemon.root / "roots" / "ws")
    result = done["result"]
    assert result["ok"] is True and result["exit_code"] == 0 and done["exit_code"] == 0
    assert result["files"] >= 20 and result["chunks"] >= 1 and result["snapshot"]
    assert done["progress"]["phase"] in ("done", "swap", "extract")
    # a URI and an explicit dest inside a root work too
    adhoc = daemon.pull(f"local:{daemon.root}/ws", f"{daemon.root}/roots/nested/adhoc")
    daemon.wait_job(adhoc["id"])
    assert_same_tree(daemon.root / "ws", daemon.root / "roots" / "nested" / "adhoc")
    status, listed = daemon.request("GET", "/v1/pulls?state=succeeded&sandbox=ws")
    assert status == 200
    assert job["id"] in [j["id"] for j in listed["jobs"]]
    assert all(j["state"] == "succeeded" and j["sandbox"] == "ws" for j in listed["jobs"])


def test_scheduled_pull_lands_exact_tree(daemon: DaemonProcess) -> None:
    def scheduled() -> Any:
        _, listed = daemon.request("GET", "/v1/pulls?sandbox=sched&state=succeeded")
        return [j for j in listed["jobs"] if j["trigger"] == "schedule"]

    jobs = daemon.wait_until(scheduled, timeout=45, what="a scheduled pull to succeed")
    assert jobs[0]["result"]["ok"] is True
    assert_same_tree(daemon.root / "ws-sched", daemon.root / "roots" / "sched")


def test_duplicate_request_is_reconciled_and_cancel_keeps_dest_untouched(
    daemon: DaemonProcess,
) -> None:
    first = daemon.pull("slow")
    second = daemon.pull("slow", f"{daemon.root}/roots/slow")
    assert second["id"] == first["id"] and second["reconciled"] is True
    assert first["reconciled"] is False
    daemon.wait_until(
        lambda: daemon.job(first["id"])["progress"].get("chunks_done", 0) >= 1,
        what="the slow pull to make progress",
    )
    status, cancelled = daemon.request("DELETE", f"/v1/pulls/{first['id']}")
    assert status == 202, cancelled
    final = daemon.wait_job(first["id"], ("cancelled",), timeout=30)
    assert final["error_kind"] == "interrupted" and final["exit_code"] == 130
    assert not (daemon.root / "roots" / "slow").exists(), "a cancelled pull leaves DEST untouched"
    status, again = daemon.request("DELETE", f"/v1/pulls/{first['id']}")
    assert status == 409 and again["kind"] == "usage"
    # after the job ended, the same request starts a new job
    third = daemon.pull("slow")
    assert third["id"] != first["id"] and third["reconciled"] is False
    done = daemon.wait_job(third["id"], timeout=90)
    assert_same_tree(daemon.root / "ws-slow", daemon.root / "roots" / "slow")
    assert done["result"]["resumed_chunks"] > 0, "the cancelled pull's journal was reused"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": TOKEN}, 401)],
)
def test_every_v1_route_needs_the_token(
    daemon: DaemonProcess, headers: dict[str, str], expected: int
) -> None:
    host, _, port = daemon.address.rpartition(":")
    for method, path in [
        ("POST", "/v1/pulls"),
        ("GET", "/v1/pulls"),
        ("GET", "/v1/pulls/x"),
        ("DELETE", "/v1/pulls/x"),
        ("GET", "/v1/events"),
        ("POST", "/v1/reload"),
        ("GET", "/v1/status"),
    ]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(method, path, body=b'{"sandbox": "ws"}', headers=headers)
            response = conn.getresponse()
            body = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == expected, (method, path)
        assert body["kind"] == "auth"
        assert response.getheader("WWW-Authenticate") == "Bearer"
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        status, _ = daemon.request("GET", path, token=None)
        assert status == 200, path


def test_destination_and_request_validation(daemon: DaemonProcess, tmp_path: Path) -> None:
    root = daemon.root / "roots"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    cases: list[tuple[Any, int, str]] = [
        ({"sandbox": "ws", "dest": str(outside / "x")}, 403, "outside the allowed roots"),
        ({"sandbox": "ws", "dest": f"{root}/escape/x"}, 403, "outside the allowed roots"),
        ({"sandbox": "ws", "dest": f"{root}/a/../../x"}, 422, "'..'"),
        ({"sandbox": "ws", "dest": "relative/x"}, 422, "absolute"),
        ({"sandbox": "ws", "dest": str(root)}, 403, "is a dest root itself"),
        ({"sandbox": "nope"}, 422, "unknown sandbox 'nope'"),
        ({"sandbox": "ftp://h/x", "dest": f"{root}/f"}, 422, "unknown sandbox scheme"),
        ({"sandbox": "ssh://h/x"}, 422, "dest is required"),
        ({"sandbox": "local:/etc", "dest": f"{root}/etc"}, 403, "outside api.local_roots"),
        ({"sandbox": f"local:{root}/escape", "dest": f"{root}/e"}, 403, "api.local_roots"),
        ({"sandbox": ""}, 422, "body.sandbox"),
        ({"sandbox": "ws", "extra": 1}, 422, "body.extra"),
        ({"dest": "/x"}, 422, "body.sandbox: Field required"),
        ([1, 2], 422, "JSON object"),
    ]
    for body, status, message in cases:
        got, answer = daemon.request("POST", "/v1/pulls", body)
        assert (got, message in answer["error"]) == (status, True), (body, answer)
    got, answer = daemon.request("POST", "/v1/pulls", raw=b'{"sandbox": ')
    assert got == 422 and "JSON" in answer["error"]
    got, answer = daemon.request("GET", "/v1/pulls?state=bogus")
    assert got == 422 and "bogus" in answer["error"]
    got, answer = daemon.request("GET", "/v1/pulls/j-missing")
    assert got == 404 and "j-missing" in answer["error"]
    assert not (outside / "x").exists()


def test_openapi_document_describes_the_api(daemon: DaemonProcess) -> None:
    status, doc = daemon.request("GET", "/openapi.json", token=None)
    assert status == 200 and doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for path in ("/v1/pulls", "/v1/pulls/{job_id}", "/v1/events", "/v1/reload", "/metrics"):
        assert path in paths
    assert set(paths["/v1/pulls"]) == {"get", "post"}
    assert "PullRequest" in doc["components"]["schemas"]


def test_events_stream_job_changes_and_progress(daemon: DaemonProcess) -> None:
    host, _, port = daemon.address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/v1/events", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type", "").startswith("text/event-stream")
        job = daemon.pull("ws", f"{daemon.root}/roots/events")
        seen: list[tuple[str, dict[str, Any]]] = []
        event = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = response.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                if data.get("id") == job["id"]:
                    seen.append((event, data))
                    if event == "job" and data["state"] == "succeeded":
                        break
    finally:
        conn.close()
    states = [d["state"] for e, d in seen if e == "job"]
    assert states[-1] == "succeeded"
    assert "running" in states
    assert seen[-1][1]["result"]["ok"] is True


def test_reload_by_sighup_and_api_keeps_old_config_on_error(daemon: DaemonProcess) -> None:
    good = daemon.config_path.read_text(encoding="utf-8")
    try:
        daemon.config_path.write_text(
            good + f'\n[sandboxes.added]\nuri = "local:{daemon.root}/ws"\n', encoding="utf-8"
        )
        daemon.signal(signal.SIGHUP)
        daemon.wait_until(
            lambda: "added" in daemon.request("GET", "/v1/status")[1]["sandboxes"],
            what="SIGHUP to reload the config",
        )
        daemon.config_path.write_text(good + "\n[limits]\nparallel = 0\n", encoding="utf-8")
        status, answer = daemon.request("POST", "/v1/reload")
        assert status == 422 and "config error" in answer["error"], answer
        assert "added" in daemon.request("GET", "/v1/status")[1]["sandboxes"], "old config kept"
    finally:
        daemon.config_path.write_text(good, encoding="utf-8")
    status, answer = daemon.request("POST", "/v1/reload")
    assert status == 200 and answer["reloaded"] is True
    assert "added" not in answer["sandboxes"]
    _, metrics = daemon.request("GET", "/metrics", token=None)
    assert 'wsync_config_reloads_total{outcome="failed"} 1.0' in metrics


def test_cli_status_and_jobs(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WSYNC_API_TOKEN", TOKEN)
    job = daemon.pull("ws", f"{daemon.root}/roots/cli")
    assert status_main(["--url", daemon.url, job["id"], "--wait"]) == 0
    out = capsys.readouterr().out
    assert job["id"] in out and "succeeded" in out
    assert jobs_main(["--url", daemon.url, "--json", "--state", "succeeded"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert job["id"] in [j["id"] for j in listed]
    assert jobs_main(["--url", daemon.url, "--sandbox", "ws"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["ID", "STATE", "SANDBOX"]
    assert status_main(["--url", daemon.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True
    assert status_main(["--url", daemon.url, "j-nope"]) == 2
    assert "404" in capsys.readouterr().err
    token_file = daemon.root / "cli-token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    monkeypatch.delenv("WSYNC_API_TOKEN")
    assert status_main(["--url", daemon.url, "--token-file", str(token_file)]) == 0
    assert status_main(["--url", daemon.url]) == 2  # no token at all
    assert status_main(["--url", "http://127.0.0.1:9", "--token-file", str(token_file)]) == 3
    assert "cannot reach" in capsys.readouterr().err
    assert tree_of(daemon.root / "ws") == tree_of(daemon.root / "roots" / "cli")


def test_cli_tables_show_caller_text_escaped(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's dest comes from whoever called the API: a title change, a clear screen or a
    line break in it reached the terminal of whoever ran ``wsync jobs``."""
    monkeypatch.setenv("WSYNC_API_TOKEN", TOKEN)
    hostile = f"{daemon.root}/roots/e\x1b]0;pwned\x07\x1b[2J\nfake-row"
    job = daemon.pull("ws", hostile)
    assert status_main(["--url", daemon.url, job["id"], "--wait"]) == 0
    shown = capsys.readouterr().out
    assert jobs_main(["--url", daemon.url]) == 0
    shown += capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown
    assert "\\x1b]0;pwned" in shown and "\\nfake-row" in shown
    assert not any(line.startswith("fake-row") for line in shown.splitlines())
    assert status_main(["--url", daemon.url, "j-nope"]) == 2
    err = capsys.readouterr().err
    assert "404" in err and "b'" not in err  # the body's message, not a bytes repr


def test_logs_are_json_lines_with_job_context(daemon: DaemonProcess) -> None:
    job = daemon.pull("ws", f"{daemon.root}/roots/logs")
    daemon.wait_job(job["id"])
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    mine = [rec for rec in lines if rec.get("job_id") == job["id"]]
    events = {rec["event"] for rec in mine}
    assert {"pull.start", "pull.end"} <= events, events
    end = next(rec for rec in mine if rec["event"] == "pull.end")
    assert end["sandbox"] == "ws" and end["snapshot"] and end["state"] == "succeeded"
