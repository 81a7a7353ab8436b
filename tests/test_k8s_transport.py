"""``k8s://``: kubeconfig as kubectl reads it, TLS, auth, pods, containers and subprotocols,
against the HTTPS emulator (a real TLS server with a throwaway CA on loopback)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ProcessWatch
from wsync.emulators.k8s import EMULATOR_TOKEN, K8sEmulatorThread, K8sFaults
from wsync.emulators.k8s_pki import ThrowawayCA
from wsync.errors import (
    AuthFailed,
    SandboxUnreachable,
    TransportError,
    UsageError,
    WsyncError,
)
from wsync.transports import k8s_protocol as kp
from wsync.transports.base import ExecResult
from wsync.transports.k8s import K8sTransport, split_target
from wsync.transports.kubeconfig import load
from wsync.transports.registry import open_transport
from wsync.uri import parse


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEmulatorThread]:
    with K8sEmulatorThread(tmp_path_factory.mktemp("k8s")) as emu:
        emu.create_pod("web")
        emu.create_pod("web", "team-a")
        emu.create_pod("multi", containers=("app", "sidecar"))
        emu.create_pod("annotated", containers=("app", "sidecar"), default_container="sidecar")
        yield emu


def run(uri: str, options: dict[str, Any], argv: list[str], **kw: Any) -> ExecResult:
    async def main() -> ExecResult:
        _, transport = open_transport(uri, options)
        async with transport:
            return await transport.exec(argv, timeout=30, **kw)

    return asyncio.run(main())


def kubeconfig_doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def test_token_and_client_certificate_contexts_both_work(cluster: K8sEmulatorThread) -> None:
    opts = cluster.transport_options()
    assert run("k8s://default/web/w", opts, ["echo", "hi"]).stdout == b"hi\n"
    cert = {**opts, "context": "emulator-cert"}
    result = run("k8s://default/web/w", cert, ["sh", "-c", "echo out; exit 4"])
    assert (result.stdout, result.exit_status) == (b"out\n", 4)


def test_the_dash_namespace_is_the_contexts(cluster: K8sEmulatorThread, tmp_path: Path) -> None:
    doc = kubeconfig_doc(cluster.kubeconfig)
    doc["contexts"][0]["context"]["namespace"] = "team-a"
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    uri = parse("k8s://-/web/work")
    transport = K8sTransport.from_uri(uri, {"kubeconfig": str(path)})
    assert transport.namespace == "team-a"
    assert transport.workspace == "/work"
    ran = run("k8s://-/web/w", {"kubeconfig": str(path)}, ["pwd"])
    assert ran.stdout.decode().strip().endswith("team-a/web")


def test_wrong_token_is_an_auth_failure_exit_3(cluster: K8sEmulatorThread, tmp_path: Path) -> None:
    doc = kubeconfig_doc(cluster.kubeconfig)
    doc["users"][0]["user"]["token"] = "not-the-token"
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(AuthFailed) as info:
        run("k8s://default/web/w", {"kubeconfig": str(path)}, ["true"])
    assert info.value.exit_code == 3
    assert "not-the-token" not in str(info.value)


def test_a_server_signed_by_another_ca_is_refused(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    """TLS is verified: the emulator's own certificate fails against a stranger's CA."""
    doc = kubeconfig_doc(cluster.kubeconfig)
    other = ThrowawayCA("someone-else")
    doc["clusters"][0]["cluster"]["certificate-authority-data"] = base64.b64encode(
        other.cert_pem
    ).decode()
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SandboxUnreachable) as info:
        run("k8s://default/web/w", {"kubeconfig": str(path)}, ["true"])
    assert "certificate" in str(info.value).lower()
    # without any CA the system store is used, which does not know the emulator either
    del doc["clusters"][0]["cluster"]["certificate-authority-data"]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SandboxUnreachable):
        run("k8s://default/web/w", {"kubeconfig": str(path)}, ["true"])


def test_unknown_pod_is_exit_3(cluster: K8sEmulatorThread) -> None:
    with pytest.raises(SandboxUnreachable, match="pod ghost not found") as info:
        run("k8s://default/ghost/w", cluster.transport_options(), ["true"])
    assert info.value.exit_code == 3
    with pytest.raises(SandboxUnreachable):
        run("k8s://nowhere/web/w", cluster.transport_options(), ["true"])


def test_several_containers_need_a_choice_exit_2(cluster: K8sEmulatorThread) -> None:
    opts = cluster.transport_options()
    with pytest.raises(UsageError, match="app, sidecar") as info:
        run("k8s://default/multi/w", opts, ["true"])
    assert info.value.exit_code == 2
    assert run("k8s://default/multi/w", {**opts, "container": "app"}, ["true"]).exit_status == 0
    with pytest.raises(UsageError, match="no container 'nope'"):
        run("k8s://default/multi/w", {**opts, "container": "nope"}, ["true"])
    # kubectl's default-container annotation decides, as kubectl does
    assert run("k8s://default/annotated/w", opts, ["true"]).exit_status == 0


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        ((kp.V5, kp.V4, kp.V4_BASE64), kp.V5),
        ((kp.V4, kp.V4_BASE64), kp.V4),
        ((kp.V4_BASE64,), kp.V4_BASE64),
        ((kp.V4_BASE64, kp.V5), kp.V4_BASE64),  # the server's preference wins
    ],
)
def test_subprotocol_negotiation_and_stdin_on_each(
    tmp_path: Path, offered: tuple[str, ...], chosen: str
) -> None:
    with K8sEmulatorThread(tmp_path / "emu", protocols=offered) as emu:
        emu.create_pod("p")

        async def main() -> None:
            _, transport = open_transport("k8s://default/p/w", emu.transport_options())
            assert isinstance(transport, K8sTransport)
            async with transport:
                payload = bytes(range(256)) * 1000
                echoed = await transport.exec(["cat"], stdin=payload, timeout=30)
                assert echoed.stdout == payload
                assert echoed.exit_status == 0
                gated = await transport.exec(
                    ["sh", "-c", 'read -r l; printf "got:%s" "$l"'], stdin=b"x\n", timeout=30
                )
                assert gated.stdout == b"got:x"
                # no stdin: EOF at once (v5: CLOSE; v4: stdin not requested)
                assert (await transport.exec(["cat"], timeout=30)).exit_status == 0
                assert transport.protocol == chosen

        asyncio.run(main())
        assert emu.stats[f"protocol {chosen}"] >= 3


def test_a_server_without_websocket_exec_protocols_is_unreachable(tmp_path: Path) -> None:
    with K8sEmulatorThread(tmp_path / "emu", protocols=("channel.k8s.io",)) as emu:
        emu.create_pod("p")
        with pytest.raises(SandboxUnreachable, match="protocol"):
            run("k8s://default/p/w", emu.transport_options(), ["true"])


def test_an_exec_cancelled_before_its_process_started_leaves_nothing(
    tmp_path: Path, procs: ProcessWatch
) -> None:
    """The race docker and daytona had (a kill that beats the process's start) has no
    counterpart here: the exec's own WebSocket is its only handle, and a cancel closes it
    (or aborts it mid-handshake), so a process the runtime starts afterwards meets a
    closed stream, which this API server ends it for."""
    arg = procs.sleep_arg()
    # exec 1 learns the subprotocol, exec 2 is the command: both start 3 s late
    with K8sEmulatorThread(tmp_path, faults=K8sFaults(start_delay=3.0, slow_starts=2)) as emu:
        emu.create_pod("web")

        async def main() -> None:
            _, transport = open_transport("k8s://default/web/w", emu.transport_options())
            async with transport:
                task = asyncio.create_task(transport.exec(["sleep", arg], timeout=60))
                for _ in range(1500):  # 30 s
                    if emu.stats["execs"] >= 2:
                        break
                    await asyncio.sleep(0.02)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        deadline = time.monotonic() + 30
        while emu.stats["slow_starts"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert emu.stats["slow_starts"] == 2, "the delayed start never came"
        left = procs.wait_gone(arg)
        procs.kill_all()
    assert left == []


def test_the_token_never_shows(cluster: K8sEmulatorThread) -> None:
    _, transport = open_transport("k8s://default/web/w", cluster.transport_options())
    for text in (transport.description, repr(transport), repr(getattr(transport, "target", ""))):
        assert EMULATOR_TOKEN not in text


# ------------------------------------------------------------------- kubeconfig


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def minimal(server: str, *, ctx: str = "c", user: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "current-context": ctx,
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user or {"token": "t1"}}],
        "contexts": [{"name": ctx, "context": {"cluster": "k", "user": "u", "namespace": "ns1"}}],
    }


def test_kubeconfig_list_merges_first_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = minimal("https://a.example:6443")
    b = minimal("https://b.example:6443", ctx="other")
    b["contexts"].append({"name": "c", "context": {"cluster": "k", "user": "u"}})
    b["users"][0]["user"] = {"token": "t2"}
    fa, fb = write(tmp_path / "a", a), write(tmp_path / "b", b)
    missing = tmp_path / "missing"
    monkeypatch.setenv("KUBECONFIG", f"{missing}:{fa}:{fb}")
    target = load({})
    # current-context, cluster "k", user "u" and context "c" all come from the first file
    assert (target.server, target.context, target.namespace) == (
        "https://a.example:6443",
        "c",
        "ns1",
    )
    assert target.headers["Authorization"] == "Bearer t1"
    # a context only the second file has is found; --kubeconfig replaces the list
    assert load({"context": "other"}).namespace == "ns1"
    assert load({"kubeconfig": str(fb)}).server == "https://b.example:6443"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(UsageError, match="KUBECONFIG"):
        load({})


def test_kubeconfig_defaults_and_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(UsageError, match="no kubeconfig"):
        load({})
    (tmp_path / ".kube").mkdir()
    doc = minimal("https://h:1")
    del doc["contexts"][0]["context"]["namespace"]
    write(tmp_path / ".kube" / "config", doc)
    assert load({}).namespace == "default"
    with pytest.raises(UsageError, match="no context 'x'"):
        load({"context": "x"})
    plugin = minimal("https://h:1", user={"exec": {"command": "aws"}})
    with pytest.raises(UsageError, match="exec plugin"):
        load({"kubeconfig": str(write(tmp_path / "p", plugin))})
    with pytest.raises(UsageError, match="credentials"):
        load({"kubeconfig": str(write(tmp_path / "q", minimal("https://u:p@h:1")))})
    proxied = minimal("https://h:1")
    proxied["clusters"][0]["cluster"]["proxy-url"] = "http://proxy:3128"
    with pytest.raises(UsageError, match="proxy-url"):
        load({"kubeconfig": str(write(tmp_path / "s", proxied))})
    with pytest.raises(UsageError, match="needs its key"):
        load({"kubeconfig": str(write(tmp_path / "r", minimal("https://h:1", user={
            "client-certificate-data": "eA=="})))})  # fmt: skip


def test_relative_ca_and_token_files_are_relative_to_the_kubeconfig(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    doc = kubeconfig_doc(cluster.kubeconfig)
    sub = tmp_path / "conf"
    sub.mkdir()
    ca = base64.b64decode(doc["clusters"][0]["cluster"].pop("certificate-authority-data"))
    (sub / "ca.crt").write_bytes(ca)
    doc["clusters"][0]["cluster"]["certificate-authority"] = "ca.crt"
    (sub / "token").write_text(EMULATOR_TOKEN + "\n")
    doc["users"][0]["user"] = {"tokenFile": "token"}
    path = write(sub / "config", doc)
    assert run("k8s://default/web/w", {"kubeconfig": str(path)}, ["true"]).exit_status == 0


@pytest.mark.parametrize(
    "raw", ["k8s://default/web", "k8s://default/web/", "k8s://a_b/web/w", "k8s://ns/We_b/w"]
)
def test_bad_uris_are_usage_errors(raw: str) -> None:
    with pytest.raises(UsageError):
        split_target(parse(raw))


def test_cli_exit_codes_for_unknown_pod_and_ambiguous_container(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    def pull(uri: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "wsync", "pull", uri, str(tmp_path / "out"), "--json",
             "--state-dir", str(tmp_path / "state"), "--kubeconfig", str(cluster.kubeconfig),
             *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    assert pull(f"k8s://default/ghost{tmp_path}").returncode == 3
    ambiguous = pull(f"k8s://default/multi{tmp_path}")
    assert ambiguous.returncode == 2
    assert "app, sidecar" in ambiguous.stdout + ambiguous.stderr
    assert pull("k8s://default/web", "--context", "emulator-cert").returncode == 2


def test_errors_are_wsync_errors_only(cluster: K8sEmulatorThread, tmp_path: Path) -> None:
    doc = kubeconfig_doc(cluster.kubeconfig)
    doc["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    path = write(tmp_path / "config", doc)
    with pytest.raises(WsyncError) as info:
        run("k8s://default/web/w", {"kubeconfig": str(path)}, ["true"])
    assert info.value.exit_code == 3


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ((200, "[]"), SandboxUnreachable),
        ((200, '{"metadata": null, "spec": {"containers": [{"name": "a"}]}}'), None),
        ((200, '{"metadata": 5, "spec": {"containers": [{"name": "a"}]}}'), SandboxUnreachable),
        ((200, '{"spec": {"containers": 7}}'), SandboxUnreachable),
        ((200, "not json"), SandboxUnreachable),
        ((200, '{"spec": {"containers": [{"name": "a"}]}, "status": {"phase": "Failed"}}'),
         SandboxUnreachable),
        ((500, "etcd is sad"), TransportError),
        ((403, "{}"), AuthFailed),
    ],
)  # fmt: skip
def test_odd_pod_lookups_are_clear_errors(
    tmp_path: Path, override: tuple[int, str], error: type[WsyncError] | None
) -> None:
    with K8sEmulatorThread(tmp_path / "emu") as emu:
        emu.create_pod("odd")
        emu.emulator.pods[("default", "odd")].lookup_override = override
        if error is None:
            assert run("k8s://default/odd/w", emu.transport_options(), ["true"]).exit_status == 0
        else:
            with pytest.raises(error):
                run("k8s://default/odd/w", emu.transport_options(), ["true"])


@pytest.mark.parametrize("name", ["A", "a b", "a/b", "x" * 64, "ü"])
def test_bad_container_names_are_usage_errors(cluster: K8sEmulatorThread, name: str) -> None:
    with pytest.raises(UsageError):
        run("k8s://default/web/w", {**cluster.transport_options(), "container": name}, ["true"])


def test_uri_names_namespace_and_pod_then_the_path() -> None:
    uri = parse("k8s://team-a/agent-0/home/agent/work")
    assert (uri.name, uri.host, uri.path) == ("team-a/agent-0", "team-a", "/home/agent/work")
    assert split_target(uri) == ("team-a", "agent-0", "/home/agent/work")
    home = parse("k8s://-/agent-0/~/work")
    assert (home.path, split_target(home)[0]) == ("~/work", None)


@pytest.mark.parametrize(
    "line",
    [
        "    token: s3cr3t-t0ken-value: oops",  # a colon too many
        '    password: "s3cr3t-t0ken-value',  # a quote left open
        "  \ttoken: s3cr3t-t0ken-value",  # a tab the scanner refuses
    ],
)
def test_a_kubeconfig_that_is_no_yaml_is_refused_without_quoting_it(
    tmp_path: Path, line: str
) -> None:
    # PyYAML's message for a syntax error quotes the line it stopped at, with a caret:
    # a token or password written there reached the terminal, a daemon job's error and
    # --json output
    path = tmp_path / "config"
    path.write_text(
        "current-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://h:1'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "users:\n"
        "- name: u\n"
        "  user:\n" + line + "\n"
    )
    with pytest.raises(UsageError) as info:
        load({"kubeconfig": str(path)})
    said = str(info.value)
    assert "s3cr3t" not in said
    assert str(path) in said and "(line 7, column" in said, said
