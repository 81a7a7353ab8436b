"""A Kubernetes API server on loopback whose pods/exec loses bytes the way the field does.

HTTPS with a throwaway CA (:mod:`wsync.emulators.k8s_pki`), written into a kubeconfig
with two users: a bearer token (context ``emulator``) and a client certificate (context
``emulator-cert``).  It serves what wsync uses:

* ``GET /api/v1/namespaces/{ns}/pods/{pod}`` — the pod's containers (404 as a ``Status``);
* ``GET .../pods/{pod}/exec?command=...`` upgraded to a WebSocket, with subprotocol
  negotiation among :attr:`K8sEmulator.protocols` (v5, v4, v4.base64 by default; the
  server's preference wins), the kubelet's initial empty frame, channel-prefixed frames,
  v5 stdin CLOSE, and the channel-3 ``Status``, then a close.

Each pod is a directory ``root/NS/POD``; an exec runs its argv as a local process there.
The faults of :mod:`wsync.emulators.k8s_faults` are drawn per exec (the lost tail is
the one a command ends with: output followed by 0.1 s of quiet while the process waits
for more stdin, a helper between requests, gets through, counted as ``tail_released``).
Wire format: :mod:`wsync.transports.k8s_protocol`, shared with the client.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import random
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from wsync.emulators.k8s_faults import ExecPlan, K8sFaults
from wsync.emulators.k8s_pki import ThrowawayCA
from wsync.emulators.sprites import (
    PIPE_GRACE,
    READ_SIZE,
    RELEASE_WINDOW,
    end_process,
    waiting_for_stdin,
)
from wsync.emulators.thread import BackgroundEmulator
from wsync.errors import ProtocolError
from wsync.transports import k8s_protocol as kp
from wsync.transports.kubeconfig import write_kubeconfig

__all__ = ["K8sEmulator", "K8sEmulatorThread", "K8sFaults"]

log = logging.getLogger(__name__)

#: the emulator's bearer token: a loopback test fixture, not a secret
EMULATOR_TOKEN = "wsync-k8s-emulator-token"  # noqa: S105
CLIENT_CN = "wsync-emulator-user"


@dataclasses.dataclass
class Pod:
    namespace: str
    name: str
    containers: tuple[str, ...]
    root: Path
    default_container: str | None = None
    phase: str = "Running"
    #: tests: (HTTP status, body) served for the pod lookup instead of the Pod
    lookup_override: tuple[int, str] | None = None

    def document(self) -> dict[str, Any]:
        annotations = {}
        if self.default_container:
            annotations["kubectl.kubernetes.io/default-container"] = self.default_container
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "annotations": annotations,
            },
            "spec": {"containers": [{"name": c, "image": "busybox"} for c in self.containers]},
            "status": {"phase": self.phase},
        }


def status_doc(code: int, reason: str, message: str) -> str:
    return json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
    )


class _Session:
    """One exec: a process, its output, one WebSocket, and this exec's faults."""

    def __init__(
        self,
        emu: K8sEmulator,
        ws: ServerConnection,
        req: kp.ExecRequest,
        pod: Pod,
        plan: ExecPlan,
        start_delay: float = 0.0,
    ) -> None:
        self.emu, self.ws, self.req, self.pod, self.plan = emu, ws, req, pod, plan
        self.start_delay = start_delay
        self.protocol = ws.subprotocol
        self.proc: asyncio.subprocess.Process | None = None
        self.queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(maxsize=64)
        self.exit_code = 0
        self.reading: set[int] = set()
        self.sent = 0
        #: the command's stdin is open (until the client's CLOSE, or its socket's end)
        self.stdin_open = req.stdin

    async def spawn(self) -> None:
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.req.argv,
                cwd=self.pod.root,
                stdin=asyncio.subprocess.PIPE if self.req.stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            self.emu.procs.add(self.proc)
        except OSError as err:
            # a runtime reports a missing binary as exit 127 here (containerd's text varies)
            self.exit_code = 126 if isinstance(err, PermissionError) else 127
            await self.queue.put((kp.STDERR, f"exec {self.req.argv[0]}: {err.strerror}\n".encode()))

    async def pump(self, channel: int, reader: asyncio.StreamReader) -> None:
        while True:
            self.reading.add(channel)
            data = await reader.read(READ_SIZE)
            self.reading.discard(channel)
            if not data:
                return
            await self.queue.put((channel, data))

    async def run_process(self) -> None:
        proc = self.proc
        if proc is not None:
            assert proc.stdout is not None and proc.stderr is not None
            pumps = {
                asyncio.create_task(self.pump(kp.STDOUT, proc.stdout)): kp.STDOUT,
                asyncio.create_task(self.pump(kp.STDERR, proc.stderr)): kp.STDERR,
            }
            try:
                # pipes held open by a detached child are abandoned PIPE_GRACE after exit
                loop = asyncio.get_running_loop()
                pending = set(pumps)
                exited_at: float | None = None
                while pending:
                    _, pending = await asyncio.wait(pending, timeout=0.1)
                    if not pending or proc.returncode is None:
                        continue
                    exited_at = exited_at or loop.time()
                    if loop.time() - exited_at >= PIPE_GRACE:
                        for task in pending:
                            if pumps[task] in self.reading:
                                task.cancel()
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
            code = await end_process(proc, kill=False)
            self.exit_code = code if code >= 0 else 128 - code
        await self.queue.put(None)

    async def forward_stdin(self) -> None:
        try:
            await self._forward_stdin()
        finally:
            self.stdin_open = False

    async def _forward_stdin(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                try:
                    frame = kp.decode(message, self.protocol)
                except ProtocolError as err:
                    log.debug("k8s emulator: bad client frame: %s", err)
                    continue
                stdin = self.proc.stdin if self.proc is not None else None
                if stdin is None:
                    continue
                try:
                    if isinstance(frame, kp.Data) and frame.channel == kp.STDIN:
                        stdin.write(frame.data)
                        await stdin.drain()
                    elif isinstance(frame, kp.Close) and frame.channel == kp.STDIN:
                        self.stdin_open = False
                        stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    continue

    async def send(self, channel: int, data: bytes) -> None:
        pieces = [data]
        if self.plan.split and len(data) > 1:
            cuts = sorted(self.plan.rng.sample(range(1, len(data)), min(3, len(data) - 1)))
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        for piece in pieces:
            sever = self.plan.sever_after
            if sever is not None and self.sent + len(piece) > sever:
                cut = piece[: max(sever - self.sent, 0)]
                if cut:
                    await self.ws.send(kp.encode(channel, cut, self.protocol))
                self.emu.stats["severed"] += 1
                self.ws.transport.abort()
                raise ConnectionAbortedError("severed by fault plan")
            await self.ws.send(kp.encode(channel, piece, self.protocol))
            self.sent += len(piece)

    async def send_status(self, payload: bytes) -> None:
        await self.ws.send(kp.encode(kp.ERROR, payload, self.protocol))

    async def write_output(self) -> None:
        plan = self.plan
        # the kubelet's greeting: an empty message on the lowest writable channel
        await self.ws.send(kp.encode(kp.STDOUT, b"", self.protocol))
        held = bytearray()  # the stdout tail withheld by drop_tail
        total = 0
        first = True
        while True:
            if held:
                try:
                    item = await asyncio.wait_for(self.queue.get(), RELEASE_WINDOW)
                except TimeoutError:
                    # output then quiet, while the command waits for more stdin (a
                    # helper between requests): the tail the fault takes is the one a
                    # command ends with (on v4 a stdin never closed stays open here,
                    # and only the wait tells)
                    if self.stdin_open and waiting_for_stdin(self.proc):
                        self.emu.stats["tail_released"] += 1
                        await self.send(kp.STDOUT, bytes(held))
                        held.clear()
                    continue
            else:
                item = await self.queue.get()
            if item is None:
                break
            channel, data = item
            if first and plan.stall:
                self.emu.stats["stalls"] += 1
                await asyncio.sleep(plan.stall)
            if channel == kp.STDOUT and plan.drop_tail:
                total += len(data)
                held += data
                if len(held) <= plan.drop_tail:
                    continue
                data = bytes(held[: len(held) - plan.drop_tail])
                del held[: len(held) - plan.drop_tail]
            await self.send(channel, data)
            early = plan.early_success or (
                self.emu.faults.stdinless_early_success and not self.req.stdin
            )
            if first and channel == kp.STDOUT and early:
                self.emu.stats["early_success"] += 1
                await self.send_status(kp.encode_status(0))
                return
            first = False
        if held and total <= self.emu.faults.drop_tail_over:
            await self.send(kp.STDOUT, bytes(held))
        elif held:
            self.emu.stats["tail_dropped"] += 1
            self.emu.stats["tail_dropped_bytes"] += len(held)
        if plan.no_status:
            self.emu.stats["no_status"] += 1
            return
        if plan.internal_error and self.exit_code == 0:
            self.emu.stats["internal_error"] += 1
            await self.send_status(kp.encode_status(None, reason="InternalError"))
        elif plan.bad_exit is not False:
            self.emu.stats["bad_exit"] += 1
            await self.send_status(self._bad_exit_status(plan.bad_exit))
        else:
            await self.send_status(kp.encode_status(self.exit_code))

    @staticmethod
    def _bad_exit_status(cause: str | bool | None) -> bytes:
        details: dict[str, Any] = {"causes": []}
        if isinstance(cause, str):
            details["causes"] = [{"reason": "ExitCode", "message": cause}]
        doc = {
            "metadata": {},
            "status": "Failure",
            "message": "command terminated with non-zero exit code",
            "reason": "NonZeroExitCode",
            "details": details,
        }
        return json.dumps(doc).encode()

    async def run(self) -> None:
        if self.start_delay > 0:
            # the upgrade is answered; the runtime starts the process later
            await asyncio.sleep(self.start_delay)
        await self.spawn()
        if self.start_delay > 0:
            self.emu.stats["slow_starts"] += 1  # counted once the process exists
        tasks = [
            asyncio.create_task(self.run_process()),
            asyncio.create_task(self.forward_stdin()),
        ]
        writer = asyncio.create_task(self.write_output())
        closed = asyncio.create_task(self.ws.wait_closed())
        try:
            await asyncio.wait({writer, closed}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and not writer.cancelled() and writer.exception() is None:
                await self.ws.close()
        finally:
            for task in [*tasks, writer, closed]:
                task.cancel()
            await asyncio.gather(*tasks, writer, closed, return_exceptions=True)
            if self.proc is not None:
                await end_process(self.proc, kill=self.proc.returncode is None)
                self.emu.procs.discard(self.proc)


class K8sEmulator:
    """The API server: ``await start()``, then :attr:`kubeconfig`; ``await stop()``."""

    def __init__(
        self,
        root: Path,
        *,
        faults: K8sFaults | None = None,
        protocols: tuple[str, ...] = (kp.V5, kp.V4, kp.V4_BASE64),
        token: str = EMULATOR_TOKEN,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.root = Path(root)
        self.faults = faults or K8sFaults.off()
        self.protocols = protocols
        self.token = token
        self.host = host
        self.port = port
        self.stats: collections.Counter[str] = collections.Counter()
        self.procs: set[asyncio.subprocess.Process] = set()
        self.pods: dict[tuple[str, str], Pod] = {}
        self.ca = ThrowawayCA()
        self._server: Server | None = None
        self._execs = 0

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def transport_options(self) -> dict[str, Any]:
        return {"kubeconfig": str(self.kubeconfig)}

    def create_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        containers: tuple[str, ...] = ("main",),
        default_container: str | None = None,
    ) -> Path:
        path = self.root / "pods" / namespace / name
        path.mkdir(parents=True, exist_ok=True)
        self.pods[(namespace, name)] = Pod(namespace, name, containers, path, default_container)
        return path

    def _server_ssl(self) -> ssl.SSLContext:
        pki = self.root / "pki"
        pki.mkdir(parents=True, exist_ok=True, mode=0o700)
        issued = self.ca.issue("kube-apiserver", ip=self.host, server=True)
        (pki / "server.pem").write_bytes(issued.cert_pem)
        (pki / "server.key").write_bytes(issued.key_pem)
        os.chmod(pki / "server.key", 0o600)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
        ctx.load_verify_locations(cadata=self.ca.cert_pem.decode("ascii"))
        ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    def write_kubeconfig(self, path: Path | None = None, *, namespace: str = "default") -> Path:
        import base64

        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode("ascii")

        client = self.ca.issue(CLIENT_CN, org="system:masters", server=False)
        path = path or self.kubeconfig
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [
                {
                    "name": "emulator",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": b64(self.ca.cert_pem),
                    },
                }
            ],
            "users": [
                {"name": "token-user", "user": {"token": self.token}},
                {
                    "name": "cert-user",
                    "user": {
                        "client-certificate-data": b64(client.cert_pem),
                        "client-key-data": b64(client.key_pem),
                    },
                },
            ],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {
                        "cluster": "emulator",
                        "user": "token-user",
                        "namespace": namespace,
                    },
                },
                {
                    "name": "emulator-cert",
                    "context": {"cluster": "emulator", "user": "cert-user", "namespace": namespace},
                },
            ],
        }
        write_kubeconfig(path, doc)
        return path

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = await serve(
            self._handle,
            self.host,
            self.port,
            ssl=self._server_ssl(),
            process_request=self._check_request,
            select_subprotocol=self._select_subprotocol,
            compression=None,
            max_size=16 * 1024 * 1024,
            close_timeout=2,
        )
        sock = next(iter(self._server.sockets))
        self.port = sock.getsockname()[1]
        self.write_kubeconfig()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for proc in list(self.procs):
            await end_process(proc, kill=proc.returncode is None)
        self.procs.clear()

    async def __aenter__(self) -> K8sEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _select_subprotocol(
        self, conn: ServerConnection, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None:
        for protocol in self.protocols:
            if protocol in offered:
                return Subprotocol(protocol)
        return None

    def _authorized(self, conn: ServerConnection, request: Request) -> bool:
        header = request.headers.get("Authorization", "")
        if hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode()):
            return True
        peer = conn.transport.get_extra_info("peercert")
        if peer:
            subject = dict(item[0] for item in peer.get("subject", ()))
            return subject.get("commonName") == CLIENT_CN
        return False

    def _check_request(self, conn: ServerConnection, request: Request) -> Response | None:
        def reply(status: int, reason: str, message: str) -> Response:
            self.stats[f"http_{status}"] += 1
            response = conn.respond(status, status_doc(status, reason, message) + "\n")
            response.headers["Content-Type"] = "application/json"
            return response

        if not self._authorized(conn, request):
            return reply(401, "Unauthorized", "Unauthorized")
        found = kp.parse_pod_path(request.path)
        if found is None:
            return reply(404, "NotFound", "the server could not find the requested resource")
        namespace, name, sub = found
        pod = self.pods.get((namespace, name))
        if pod is None:
            return reply(404, "NotFound", f'pods "{name}" not found')
        if sub == "" and pod.lookup_override is not None:
            return conn.respond(*pod.lookup_override)
        if sub == "":
            response = conn.respond(200, json.dumps(pod.document()) + "\n")
            response.headers["Content-Type"] = "application/json"
            return response
        if sub != "exec":
            return reply(404, "NotFound", "the server could not find the requested resource")
        try:
            req = kp.parse_exec_path(request.path)
        except ProtocolError as err:
            return reply(400, "BadRequest", str(err))
        assert req is not None
        if req.container is None and len(pod.containers) > 1:
            names = " ".join(pod.containers)
            return reply(
                400,
                "BadRequest",
                f"a container name must be specified for pod {name}, choose one of: [{names}]",
            )
        if req.container is not None and req.container not in pod.containers:
            return reply(
                400, "BadRequest", f"container {req.container} is not valid for pod {name}"
            )
        offered = [
            p.strip()
            for value in request.headers.get_all("Sec-WebSocket-Protocol")
            for p in value.split(",")
        ]
        if not any(p in offered for p in self.protocols):
            return reply(400, "BadRequest", "no supported channel protocol offered")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        req = kp.parse_exec_path(ws.request.path)
        assert req is not None  # checked in _check_request
        pod = self.pods[(req.namespace, req.pod)]
        self._execs += 1
        plan = self.faults.plan(random.Random(f"{self.faults.seed}/{self._execs}"))  # noqa: S311
        self.stats["execs"] += 1
        self.stats[f"protocol {ws.subprotocol}"] += 1
        faults = self.faults
        delay = faults.start_delay if self._execs <= faults.slow_starts else 0.0
        try:
            await _Session(self, ws, req, pod, plan, delay).run()
        except (ConnectionClosed, ConnectionAbortedError, OSError) as err:
            log.debug("k8s emulator: session ended: %r", err)


class K8sEmulatorThread(BackgroundEmulator[K8sEmulator, K8sFaults]):
    """A :class:`K8sEmulator` on its own loop in a background thread (demo, doctor, tests)::

    with K8sEmulatorThread(root, faults=K8sFaults.all_on()) as emu:
        emu.create_pod("demo")
        pull_uri("k8s://default/demo/work", dest, opts, emu.transport_options())
    """

    thread_name = "k8s-emulator"

    def __init__(
        self,
        root: Path,
        *,
        faults: K8sFaults | None = None,
        protocols: tuple[str, ...] = (kp.V5, kp.V4, kp.V4_BASE64),
    ) -> None:
        super().__init__(K8sEmulator(root, faults=faults, protocols=protocols))

    @property
    def kubeconfig(self) -> Path:
        return self.emulator.kubeconfig

    def create_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        containers: tuple[str, ...] = ("main",),
        default_container: str | None = None,
    ) -> Path:
        return self.emulator.create_pod(
            name, namespace, containers=containers, default_container=default_container
        )

    def set_protocols(self, protocols: tuple[str, ...]) -> None:
        self.emulator.protocols = protocols
