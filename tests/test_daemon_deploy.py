"""Deployment files: they parse, they are hardened, and they name real commands and paths.

These files are never run by the suite (no systemd boot, no docker build), so
the checks are the ones that catch real mistakes: ``systemd-analyze verify``
on the unit, YAML that parses with the keys Kubernetes/compose need, and every
path, port, route and command they mention existing in this repository.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from wsync.daemon.config import DEFAULT_LISTEN, DaemonConfig, SandboxConfig, load_config

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "wsync.service"
DEPLOY = REPO / "deploy"
PORT = DEFAULT_LISTEN.rpartition(":")[2]


def _unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_is_hardened_notify_service() -> None:
    unit = _unit_settings()
    expect = {
        "Type": "notify",
        "User": "wsync",
        "ProtectSystem": "strict",
        "StateDirectory": "wsync",
        "NoNewPrivileges": "yes",
        "Restart": "on-failure",
        "ExecReload": "/bin/kill -HUP $MAINPID",
    }
    for key, value in expect.items():
        assert unit.get(key) == [value], key
    assert unit["ReadWritePaths"] == ["/srv/workspaces"]
    assert unit["ExecStart"][0].split()[1:] == ["daemon", "--config", "/etc/wsync/config.toml"]
    assert "WatchdogSec" in unit
    # the unit's paths agree with the example config
    example = tomllib.loads((REPO / "config.example.toml").read_text(encoding="utf-8"))
    assert example["state_dir"] == "/var/lib/" + unit["StateDirectory"][0]
    assert example["dest_roots"] == unit["ReadWritePaths"]


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this checkout's real entry point
    wsync = shutil.which("wsync") or sys.executable
    text = UNIT.read_text(encoding="utf-8").replace("/usr/local/bin/wsync", wsync)
    unit = tmp_path / "wsync.service"
    unit.write_text(text, encoding="utf-8")
    result = subprocess.run(
        [analyze, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for complaint in ("Unknown key", "Failed to parse", "ignoring", "Invalid"):
        assert complaint not in output, output


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, args = line.partition(" ")
            out.append((instr.upper(), args.strip()))
    return out


def test_dockerfile_is_non_root_with_healthcheck_and_real_paths() -> None:
    steps = _dockerfile()
    instrs = [i for i, _ in steps]
    assert instrs[0] == "FROM"
    assert instrs.index("USER") > max(i for i, (s, _) in enumerate(steps) if s == "RUN")
    user = dict(steps)["USER"]
    assert not user.startswith(("root", "0")), "the image must not run as root"
    for instr, args in steps:
        if instr == "COPY":
            *sources, _dest = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY source {source} missing from the repo"
    entry = dict(steps)["ENTRYPOINT"]
    assert entry == '["wsync", "daemon"]'
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "wsync" in scripts["scripts"], "ENTRYPOINT runs the project's console script"
    assert dict(steps)["EXPOSE"] == PORT
    health = dict(steps)["HEALTHCHECK"]
    assert f"http://127.0.0.1:{PORT}/healthz" in health
    cmd = dict(steps)["CMD"]
    assert "/etc/wsync/config.toml" in cmd
    # the baked-in config is valid, and the daemon's argument parser takes the CMD
    config = load_config(DEPLOY / "sidecar.toml")
    assert config.api.listen == DEFAULT_LISTEN
    assert [str(p) for p in config.dest_roots] == ["/workspaces"]
    assert "/workspaces" in dict(steps)["VOLUME"]


def test_python_m_wsync_daemon_help_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "wsync.daemon", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    for flag in ("--config", "--listen", "--state-dir"):
        assert flag in result.stdout


def _yaml(path: Path) -> Any:
    """Parse with PyYAML when it is installed (it is not a wsync dependency)."""
    try:
        import yaml
    except ImportError:
        return None
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_kubernetes_pod_runs_wsync_as_a_sidecar_sharing_the_workspace_volume() -> None:
    path = DEPLOY / "k8s-pod.yaml"
    text = path.read_text(encoding="utf-8")
    assert "\t" not in text, "YAML must not contain tabs"
    for needle in ("kind: Pod", "restartPolicy: Always", "path: /readyz", "path: /healthz"):
        assert needle in text, needle
    pod = _yaml(path)
    if pod is None:  # PyYAML absent: the textual checks above are all we can do
        return
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    spec = pod["spec"]
    (wsync,) = [c for c in spec["initContainers"] if c["name"] == "wsync"]
    (agent,) = spec["containers"]
    assert wsync["restartPolicy"] == "Always"  # a native sidecar
    assert wsync["args"] == ["--config", "/etc/wsync/config.toml"]
    assert wsync["securityContext"]["runAsUser"] != 0
    assert wsync["securityContext"]["allowPrivilegeEscalation"] is False
    assert {p["containerPort"] for p in wsync["ports"]} == {int(PORT)}
    assert wsync["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e for e in wsync["env"]}
    assert "secretKeyRef" in env["WSYNC_API_TOKEN"]["valueFrom"], "token from a Secret"
    shared = {m["name"] for m in wsync["volumeMounts"]} & {m["name"] for m in agent["volumeMounts"]}
    assert "workspaces" in shared
    assert {v["name"] for v in spec["volumes"]} >= {"workspaces", "wsync-state"}
    mount = next(m for m in wsync["volumeMounts"] if m["name"] == "workspaces")
    assert mount["mountPath"] == "/workspaces"  # = dest_roots of deploy/sidecar.toml


def test_compose_example_builds_this_dockerfile_and_shares_volumes() -> None:
    path = DEPLOY / "compose.yaml"
    text = path.read_text(encoding="utf-8")
    assert "\t" not in text
    assert "dockerfile: deploy/Dockerfile" in text
    doc = _yaml(path)
    if doc is None:
        return
    wsync = doc["services"]["wsync"]
    assert (DEPLOY / wsync["build"]["context"] / wsync["build"]["dockerfile"]).is_file()
    assert wsync["environment"]["WSYNC_API__LISTEN"].endswith(f":{PORT}")
    assert "workspaces:/workspaces" in wsync["volumes"]
    agent = doc["services"]["orchestrator"]
    assert "workspaces:/workspaces:ro" in agent["volumes"]
    assert agent["depends_on"]["wsync"]["condition"] == "service_healthy"
    assert set(doc["volumes"]) >= {"workspaces", "wsync-state"}


def test_example_config_is_valid_and_documents_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WSYNC_API_TOKEN", "example-token-0123456789")
    config = load_config(REPO / "config.example.toml")
    assert config.sandboxes["agent1"].interval == 600
    text = (REPO / "config.example.toml").read_text(encoding="utf-8")
    keys = set(DaemonConfig.model_fields)
    for field in DaemonConfig.model_fields.values():
        model = field.annotation
        if isinstance(model, type) and hasattr(model, "model_fields"):
            keys |= set(model.model_fields)
    keys |= set(SandboxConfig.model_fields)
    missing = [k for k in sorted(keys) if not re.search(rf"(^|[#\s\[]){k}\b", text, re.M)]
    assert not missing, f"config.example.toml does not document: {missing}"
