"""The ``wsync daemon`` process pulls ``e2b://``, ``daytona://`` and ``cloudflare://``
sandboxes (issue 9): configured ones whose tokens are given by reference (``env:`` and
``file:``), and ad-hoc URIs posted to ``POST /v1/pulls`` that take the provider's usual
environment variables.  Every emulator has all its faults on, and a distinctive token, so a
token leaking into a job record, the state directory or the daemon's log is caught.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact, make_tree
from test_daemon_harness import base_config, running
from wsync.emulators.cloudflare import CloudflareFaults
from wsync.emulators.cloudflare import EmulatorThread as CloudflareThread
from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
from wsync.emulators.e2b import E2BFaults
from wsync.emulators.e2b import EmulatorThread as E2BThread

KiB = 1024
E2B_TOKEN = "e2b-tok-" + "7" * 24
DAYTONA_TOKEN = "dtn-key-" + "8" * 24
CF_TOKEN = "cf-bridge-" + "9" * 24
TOKENS = (E2B_TOKEN, DAYTONA_TOKEN, CF_TOKEN)


@pytest.fixture
def emulators(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One emulator per provider, each with its own token and every fault on."""
    with (
        E2BThread(tmp_path / "e2b", token=E2B_TOKEN) as e2b,
        DaytonaEmulatorThread(tmp_path / "daytona", token=DAYTONA_TOKEN) as daytona,
        CloudflareThread(tmp_path / "cf", token=CF_TOKEN) as cf,
    ):
        e2b.set_faults(E2BFaults.all_on(seed=31))
        daytona.set_faults(DaytonaFaults.all_on(seed=32))
        cf.set_faults(CloudflareFaults.all_on(seed=33))
        yield {"e2b": e2b, "daytona": daytona, "cloudflare": cf}


def workspace(emu: Any, sandbox: str, seed: int) -> Path:
    ws = emu.create_sandbox(sandbox) / "work"
    ws.mkdir()
    return make_tree(ws / "t", seed=seed, big=48 * KiB, small=6)


def test_the_daemon_pulls_configured_and_posted_provider_sandboxes(
    emulators: dict[str, Any], tmp_path: Path
) -> None:
    e2b, daytona, cf = emulators["e2b"], emulators["daytona"], emulators["cloudflare"]
    ws = {
        "e2b": workspace(e2b, "sbx-e2b", 1),
        "daytona": workspace(daytona, "sbx-dtn", 2),
        "cloudflare": workspace(cf, "sbx-cf", 3),
    }
    adhoc_ws = workspace(cf, "sbx-adhoc", 4)
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "daytona").write_text(DAYTONA_TOKEN + "\n")
    roots = tmp_path / "roots"
    roots.mkdir()
    # e2b by env:, daytona by file:, cloudflare by env: under a name of our choosing
    extra = f"""
[sandboxes.agent-e2b]
uri = "e2b://sbx-e2b{ws["e2b"]}"
dest = "{roots}/e2b"
options = {{ e2b_url = "{e2b.url}", e2b_keepalive_interval = 1.0, e2b_stall_factor = 2.0 }}
secrets = {{ e2b_token = "env:AGENT_E2B_TOKEN" }}

[sandboxes.agent-daytona]
uri = "daytona://sbx-dtn{ws["daytona"]}"
dest = "{roots}/daytona"
options = {{ daytona_url = "{daytona.url}" }}
secrets = {{ daytona_token = "file:{secrets}/daytona" }}

[sandboxes.agent-cf]
uri = "cloudflare://sbx-cf{ws["cloudflare"]}"
dest = "{roots}/cloudflare"
options = {{ cloudflare_url = "{cf.url}" }}
secrets = {{ cloudflare_token = "env:AGENT_CF_TOKEN" }}
"""
    env = {
        "AGENT_E2B_TOKEN": E2B_TOKEN,
        "AGENT_CF_TOKEN": CF_TOKEN,
        # what an ad-hoc cloudflare:// URI uses: the provider's own variables
        "CLOUDFLARE_SANDBOX_URL": cf.url,
        "CLOUDFLARE_SANDBOX_TOKEN": CF_TOKEN,
    }
    config = base_config(tmp_path, extra, api="allow_uris = true")
    records: list[dict[str, Any]] = []
    with running(tmp_path, config, env) as daemon:
        ids = [daemon.pull(name)["id"] for name in ("agent-e2b", "agent-daytona", "agent-cf")]
        ids.append(daemon.pull(f"cloudflare://sbx-adhoc{adhoc_ws}", f"{roots}/adhoc")["id"])
        for job_id in ids:
            done = daemon.wait_job(job_id, timeout=180)
            assert done["state"] == "succeeded", done
            records.append(done)
        status, listing = daemon.request("GET", "/v1/pulls")
        assert status == 200, listing
        log = daemon.log_path.read_bytes()

    assert_exact(ws["e2b"], roots / "e2b")
    assert_exact(ws["daytona"], roots / "daytona")
    assert_exact(ws["cloudflare"], roots / "cloudflare")
    assert_exact(adhoc_ws, roots / "adhoc")
    assert {r["id"] for r in records} == set(ids)
    assert e2b.stats["execs"] and daytona.stats["execs"] and cf.stats["requests"]

    # no token anywhere: the API's job records, the state dir (job store, logs), the log
    seen = json.dumps([records, listing])
    stored = b"".join(p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file())
    for token in TOKENS:
        assert token not in seen
        assert token.encode() not in stored
        assert token.encode() not in log
    assert log  # the daemon did log (its pulls, at least)
