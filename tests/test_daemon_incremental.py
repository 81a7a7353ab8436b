"""The daemon's share of incremental pulls: per-sandbox excludes, job records, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact, run_pull
from wsync.daemon.config import ConfigError, load_config
from wsync.daemon.jobs import JobManager
from wsync.daemon.metrics import Metrics
from wsync.daemon.store import JobStore
from wsync.engine.api import ProgressCallback, PullOptions, PullResult
from wsync.engine.excludes import Excludes
from wsync.transports.local import LocalTransport


def write_config(tmp_path: Path, exclude: str) -> Path:
    (tmp_path / "roots").mkdir(exist_ok=True)
    (tmp_path / "ws").mkdir(exist_ok=True)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'dest_roots = ["{tmp_path / "roots"}"]\n'
        "[sandboxes.box]\n"
        f'uri = "local:{tmp_path / "ws"}"\n'
        f'dest = "{tmp_path / "roots" / "box"}"\n'
        f"exclude = {exclude}\n"
        "[sandboxes.plain]\n"
        f'uri = "local:{tmp_path / "ws"}"\n',
        encoding="utf-8",
    )
    return cfg


def test_exclude_is_validated_at_load_and_passed_to_the_pull(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, '["node_modules/", "*.pyc", "/build"]'))
    box = config.sandboxes["box"]
    assert box.exclude == ["node_modules/", "*.pyc", "/build"]
    options = config.pull_options(box)
    assert options.excludes == Excludes(("node_modules/", "*.pyc", "/build"))
    assert options.excludes.excluded(b"a/b.pyc", False)
    assert config.pull_options(config.sandboxes["plain"]).excludes == Excludes.none()
    assert config.pull_options(None).excludes == Excludes.none()


@pytest.mark.parametrize("bad", ['["ok", "x["]', '["a**b"]', '[""]', '"*.pyc"'])
def test_a_malformed_exclude_is_one_config_error(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, bad))
    assert err.value.exit_code == 2
    assert "sandboxes.box.exclude" in str(err.value)
    assert "\n" not in str(err.value)


async def _one_job(manager: JobManager) -> dict[str, Any]:
    """Submit a pull of ``box`` and wait (within a generous deadline) for its record."""
    job, _ = manager.submit("box", None)
    deadline = time.monotonic() + 120
    while manager.get(job.id).state not in ("succeeded", "failed"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    return manager.get(job.id).to_json()


def test_job_record_and_metrics_show_mode_counts_and_bytes(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, '["*.log"]'))
    seen: list[PullOptions] = []
    results = [
        PullResult(ok=True, sandbox="", dest="", mode="full", changed_files=120,
                   transferred_bytes=5_000_000, tree_bytes=9_000_000),
        PullResult(ok=True, sandbox="", dest="", mode="incremental", changed_files=3,
                   deleted_files=2, transferred_bytes=40_000, tree_bytes=9_100_000),
    ]  # fmt: skip

    async def puller(
        uri: str,
        dest: Path,
        options: PullOptions,
        transport_options: Mapping[str, Any] | None,
        on_progress: ProgressCallback | None,
    ) -> PullResult:
        seen.append(options)
        result = results[len(seen) - 1]
        result.sandbox, result.dest = uri, str(dest)
        return result

    async def run() -> list[dict[str, Any]]:
        store = JobStore(tmp_path / "jobs.sqlite")
        metrics = Metrics()
        manager = JobManager(config, store, metrics, puller=puller)
        await manager.start()
        records = []
        for _ in results:
            records.append(await _one_job(manager))
        await manager.shutdown(5)
        text = metrics.render().decode()
        store.close()
        records.append({"metrics": text})
        return records

    *jobs, last = asyncio.run(run())
    assert [o.excludes for o in seen] == [Excludes(("*.log",))] * 2
    assert jobs[0]["state"] == "succeeded"
    result = jobs[1]["result"]
    assert result["mode"] == "incremental"
    assert (result["changed_files"], result["deleted_files"]) == (3, 2)
    assert (result["transferred_bytes"], result["tree_bytes"]) == (40_000, 9_100_000)
    text = last["metrics"]
    assert 'wsync_pull_modes_total{mode="full",sandbox="box"} 1.0' in text
    assert 'wsync_pull_modes_total{mode="incremental",sandbox="box"} 1.0' in text
    assert 'wsync_changed_files_total{sandbox="box"} 123.0' in text
    assert 'wsync_deleted_files_total{sandbox="box"} 2.0' in text
    assert 'wsync_tree_bytes_total{sandbox="box"} 1.81e+07' in text
    assert 'wsync_last_pull_transferred_bytes{sandbox="box"} 40000.0' in text
    assert 'wsync_last_pull_tree_bytes{sandbox="box"} 9.1e+06' in text


def test_keep_prev_reaches_the_pull_and_its_tree_stays_beneath_the_root(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "[]\nkeep_prev = true"))
    options = config.pull_options(config.sandboxes["box"])
    assert options.keep_prev
    assert not config.pull_options(config.sandboxes["plain"]).keep_prev
    ws, roots = tmp_path / "ws", tmp_path / "roots"
    (ws / "a").write_text("one\n")
    (ws / "b").write_text("b\n")
    opts = dataclasses.replace(options, dest_root=roots)
    for text in ("one\n", "two\n", "three, longer\n"):
        (ws / "a").write_text(text)
        result = run_pull(LocalTransport(), ws, roots / "box", opts)
        assert result.ok, result.error
        assert_exact(ws, roots / "box")
    assert result.mode == "incremental"
    assert sorted(p.name for p in roots.iterdir()) == [".box.wsync-prev", "box"]
    assert os.stat(roots / ".box.wsync-prev" / "b").st_ino == os.stat(roots / "box" / "b").st_ino


def test_a_sandbox_stuck_on_a_snapshot_over_the_limits_heals_by_itself(tmp_path: Path) -> None:
    """A periodic pull refused by ``limits.max_bytes`` left its snapshot to resume, and each
    later pull resumed it and was refused again, for a day (the staging's TTL), even once
    the agent had deleted what was too big; the daemon had no --restart.  A resumed
    snapshot over the limits now gives way to the workspace as it is."""
    cfg = write_config(tmp_path, "[]")
    cfg.write_text(
        cfg.read_text() + "[limits]\nmax_bytes = 50000\nmin_free_bytes = 0\n", encoding="utf-8"
    )
    config = load_config(cfg)
    ws = tmp_path / "ws"
    (ws / "a.txt").write_text("a\n")

    async def run() -> list[dict[str, Any]]:
        store = JobStore(tmp_path / "jobs.sqlite")
        manager = JobManager(config, store, Metrics())
        await manager.start()
        records = []
        for step in ("pull", "grow", "again", "shrink"):
            if step == "grow":
                (ws / "big.bin").write_bytes(os.urandom(100_000))
            if step == "shrink":
                (ws / "big.bin").unlink()
            records.append(await _one_job(manager))
        await manager.shutdown(5)
        store.close()
        return records

    records = asyncio.run(run())
    states = [(r["state"], (r.get("result") or {}).get("error_kind")) for r in records]
    # the failed job that gave the snapshot up says so, as the one that pulled does
    for record in records[2:]:
        warned = [w for w in record["result"]["warnings"] if "over this run's limits" in w]
        assert warned, record
    assert states == [
        ("succeeded", None),
        ("failed", "limit"),
        ("failed", "limit"),
        ("succeeded", None),
    ], states
    assert_exact(ws, tmp_path / "roots" / "box")
