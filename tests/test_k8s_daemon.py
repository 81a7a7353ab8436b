"""The daemon pulls ``k8s://`` sandboxes: from its config (kubeconfig and context as plain
options) and ad hoc through ``POST /v1/pulls`` (``$KUBECONFIG`` of the daemon)."""

from __future__ import annotations

import signal
from pathlib import Path

from test_daemon_harness import DaemonProcess, assert_same_tree, base_config, make_tree
from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults


def test_daemon_config_and_post_v1_pulls_accept_k8s(tmp_path: Path) -> None:
    (tmp_path / "roots").mkdir()
    with K8sEmulatorThread(tmp_path / "emu", faults=K8sFaults.all_on(seed=5)) as cluster:
        ws = cluster.create_pod("agent", "team-a", containers=("app", "sidecar")) / "work"
        make_tree(ws, seed=4)
        config = base_config(
            tmp_path,
            f"""
[sandboxes.pod]
uri = "k8s://team-a/agent{ws}"
dest = "{tmp_path}/roots/pod"
options = {{ kubeconfig = "{cluster.kubeconfig}", context = "emulator-cert", container = "app" }}
""",
            api="allow_uris = true",
        )
        env = {"KUBECONFIG": str(cluster.kubeconfig)}
        daemon = DaemonProcess(tmp_path, config, env)
        daemon.start()
        try:
            done = daemon.wait_job(daemon.pull("pod")["id"])
            assert done["state"] == "succeeded", done
            assert_same_tree(ws, tmp_path / "roots" / "pod")
            # ad hoc: no options, so the container choice is missing: a clear exit 2
            adhoc = daemon.pull(f"k8s://team-a/agent{ws}", f"{tmp_path}/roots/adhoc")
            failed = daemon.wait_job(adhoc["id"], states=("failed",))
            assert (failed["state"], failed["exit_code"]) == ("failed", 2), failed
            assert "sidecar" in failed["error"]
            # ad hoc on a one-container pod lands exactly
            one = cluster.create_pod("solo") / "work"
            make_tree(one, seed=6)
            job = daemon.pull(f"k8s://default/solo{one}", f"{tmp_path}/roots/solo")
            assert daemon.wait_job(job["id"])["state"] == "succeeded"
            assert_same_tree(one, tmp_path / "roots" / "solo")
        finally:
            daemon.signal(signal.SIGTERM)
            code = daemon.wait_exit()
            daemon.close()
            assert code == 0, daemon.log()
