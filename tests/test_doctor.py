"""``wsync doctor``: the field report's integrity table, against honest and lossy backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from wsync.emulators.sprites import EmulatorThread, SpritesFaults


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", "doctor", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def rows(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {row["size"] // 1024: row for row in report["rows"]}


def test_an_honest_backend_is_intact_everywhere(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()  # the staging root may not lie inside the workspace
    _, report = doctor(f"local:{tmp_path}/ws", "--staging-dir", str(tmp_path / "stage"))
    assert not report["lossy"]
    assert all(r["intact"] and r["exit"] == 0 for r in report["rows"])
    assert report["probe"]["hash"] == "xxh128"


def test_the_sprites_emulator_reproduces_the_field_report_table(tmp_path: Path) -> None:
    with EmulatorThread(tmp_path / "emu", faults=SpritesFaults.report_table()) as emu:
        emu.create_sprite("probe")
        _, report = _doctor_with_token(tmp_path, emu.transport_options())
    table = rows(report)
    assert report["lossy"]
    assert table[16]["intact"] and table[64]["intact"]
    one_mib = table[1024]
    assert one_mib["exit"] == 0 and one_mib["received"] == 65536 and one_mib["tail_match"]
    assert not table[4096]["intact"] and table[4096]["tail_match"]
    # wsync's verified read of the very same files is exact
    assert all(r["verified"] == "intact" for r in report["rows"])


def _doctor_with_token(tmp_path: Path, options: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    token = tmp_path / "token"
    token.write_text(options["token"])
    (tmp_path / "ws").mkdir()  # the staging root may not lie inside the workspace
    return doctor(
        f"sprites://probe{tmp_path}/ws",
        "--sprites-url",
        options["sprites_url"],
        "--sprites-token-file",
        str(token),
        "--staging-dir",
        str(tmp_path / "stage"),
    )


def test_doctor_prints_the_k8s_early_success(tmp_path: Path) -> None:
    """kata-containers#13640 in the doctor's table, on a v4 server (no stdin EOF, so a
    plain exec requests no stdin): large plain reads end after the first flush with a
    Success status (exit 0); wsync's verified reads, which request stdin, are exact."""
    from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults

    with K8sEmulatorThread(
        tmp_path / "emu", faults=K8sFaults.kata(), protocols=("v4.channel.k8s.io",)
    ) as cluster:
        cluster.create_pod("probe")
        (tmp_path / "ws").mkdir()
        _, report = doctor(
            f"k8s://default/probe{tmp_path}/ws",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--staging-dir",
            str(tmp_path / "stage"),
        )
    table = rows(report)
    assert report["lossy"]
    for size in (1024, 4096):
        row = table[size]
        assert row["exit"] == 0 and row["received"] < size * 1024 and not row["intact"]
    assert all(r["verified"] == "intact" for r in report["rows"])
