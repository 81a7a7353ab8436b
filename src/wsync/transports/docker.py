"""``docker://CONTAINER/PATH``: exec through the Docker Engine API, spoken directly.

No ``docker`` CLI and no SDK: create an exec, start it with the connection hijack, read
the multiplexed frames to EOF (:mod:`wsync.transports.docker_protocol`, over h11 on
asyncio streams: :mod:`wsync.transports.docker_http`), then ask ``GET /exec/{id}/json``
for the exit code.  The daemon is ``--docker-host`` / option ``docker_host``, else
``$DOCKER_HOST``, else ``unix:///var/run/docker.sock``; ``tcp://HOST:PORT`` works too.

What this client does about the field faults (it reports, the engine's envelopes verify):

* the exit code is never read from the stream's end: after EOF inspect is polled while
  ``ExitCode`` is ``null`` (moby#19607, testcontainers-go#3766, socktainer#305), for at
  most ``exit_wait`` seconds; still ``null`` then is ``exit_status=None``, never 0;
* a stream cut inside a frame (header or payload) is a :class:`TransportError`; a stream
  that simply ends early cannot be told from a complete one (a dropped final frame looks
  like EOF): that loss is what the engine's envelopes catch;
* a background child that keeps stdout open holds the EOF after the command exited
  (moby#33039): while the stream is quiet, inspect is asked every ``poll_interval``
  seconds; once the command has exited, the stream gets ``linger`` more seconds, then
  the result is returned (noted) and the holders are killed;
* the Engine API cannot kill an exec, and closing the connection does not either: every
  exec carries a random ``WSYNC_EXEC`` token in its environment, and a command this
  client abandons (deadline, cut, cancel) is killed by a second exec that signals the
  processes carrying that token in the command's session (a child that started its own
  session, like the guest producer under ``setsid``, is left alone);
* moby answers the start before the process exists, so a kill can run first and find
  nothing: a killer sent before the stream ended first creates the token's kill marker
  (``/tmp/wsync-kill-TOKEN``), and the wrapper runs nothing when it finds it;
* argv runs as ``/bin/sh -c '... exec "$@"' sh ARGV...`` (checks for the kill marker,
  records the session for the killer, then execs): exact argv, and a missing command
  is exit 127;
* a guest helper's exec stays open (:meth:`DockerTransport.open_channel`,
  :mod:`wsync.transports.docker_channel`): many calls for one exec, and answers that a
  lost final frame cannot take, as the helper goes on running after each;
* a missing container (404) is :class:`SandboxUnreachable` (exit 3), so is a daemon that
  does not answer before any exec worked, or a container that is not running (409);
  a socket without permission is :class:`AuthFailed` (exit 3).

Paths are unversioned (``/containers/...``): the daemon then speaks its own API version,
and a client pinned to a version newer than an old daemon's, or older than a new daemon's
minimum, would be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import socket
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from wsync.errors import (
    AuthFailed,
    ProtocolError,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.transports import docker_http
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    KILL_MARK,
    Capabilities,
    Channel,
    ExecResult,
    Transport,
    error_message,
    float_options,
    refuse_if_killed,
    sweep_stale_kill_marks,
)
from wsync.transports.docker_channel import DockerChannel
from wsync.transports.docker_protocol import (
    START_BODY,
    Endpoint,
    ExecCollector,
    Inspect,
    check_container,
    exec_create_body,
    parse_docker_host,
    parse_exec_id,
    parse_inspect,
)
from wsync.uri import SandboxURI

log = logging.getLogger(__name__)

#: the environment variable that marks every process of one exec (see :data:`KILL_SCRIPT`)
TOKEN_VAR = "WSYNC_EXEC"  # noqa: S105 - a variable name, not a secret
#: the command's session id, recorded by the wrapper before it execs the command
SID_VAR = "WSYNC_EXEC_SID"
#: the token's kill marker in the guest (see :data:`~wsync.transports.base.KILL_MARK`)
_MARK = f'{shlex.quote(KILL_MARK)}"${TOKEN_VAR}"'
EXEC_WRAPPER = (
    "/bin/sh",
    "-c",
    # a kill that came before this process (the start was answered, the process came
    # later) left the marker: run nothing
    refuse_if_killed(_MARK)
    + f'read -r _ _ _ _ _ {SID_VAR} _ 2>/dev/null </proc/$$/stat; export {SID_VAR}; exec "$@"',
    "sh",
)
#: kills the processes of the exec whose token is $1 and that are still in its session
#: (two passes: a shell may fork while the first runs; where grep reads past NUL bytes,
#: GNU's does and busybox's does not, one grep finds the candidates, so a busy process
#: table costs no fork per process); the token is a positional parameter, never spliced
#: into the script.  With ``$2`` = ``mark`` (the command may not have started yet) the
#: kill marker is made first, so a command whose process did not exist yet when the
#: process table was read refuses to run when it does start; once a process of the exec
#: was killed, its wrapper is known to be past that check (or dead), and the marker goes
KILL_SCRIPT = f"""t=$1
m={shlex.quote(KILL_MARK)}"$t"
if [ "$2" = mark ]; then mkdir "$m" 2>/dev/null; fi
hit=
nl='
'
for pass in 1 2; do
  if printf 'a\\000b\\n' | grep -qF b 2>/dev/null; then
    list=$(grep -lF "{TOKEN_VAR}=$t" /proc/[0-9]*/environ 2>/dev/null)
  else
    list=$(echo /proc/[0-9]*/environ)
  fi
  for f in $list; do
    d=${{f%/environ}}
    p=${{d#/proc/}}
    e=$(tr '\\000' '\\n' 2>/dev/null <"$f") || continue
    e="$nl$e$nl"
    case $e in *"${{nl}}{TOKEN_VAR}=$t$nl"*) ;; *) continue ;; esac
    want=
    case $e in
      *"${{nl}}{SID_VAR}="*) want=${{e#*"${{nl}}{SID_VAR}="}}; want=${{want%%"$nl"*}} ;;
    esac
    read -r st 2>/dev/null <"$d/stat" || continue
    st=${{st##*) }}
    set -- $st
    if [ -z "$want" ] || [ "$4" = "$want" ]; then kill -9 "$p" 2>/dev/null && hit=1; fi
  done
done
if [ -n "$hit" ]; then rmdir "$m" 2>/dev/null; fi
{sweep_stale_kill_marks()}exit 0
"""
#: bytes per write of stdin into the hijacked connection
STDIN_CHUNK = 256 * 1024


def _error(answer: docker_http.Answer) -> str:
    return f"HTTP {answer.status}: {error_message(answer.body, 300)}"


class DockerTransport(Transport):
    """One container reached through one Docker daemon; a connection per call."""

    scheme: ClassVar[str] = "docker"
    capabilities: ClassVar[Capabilities] = Capabilities(
        stdin=True,
        binary_safe=True,
        separate_stderr=True,
        file_read=False,
        channel=True,
        long_argv=True,
    )

    def __init__(
        self,
        container: str,
        *,
        endpoint: Endpoint,
        user: str | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        poll_interval: float = 1.0,
        exit_wait: float = 10.0,
        linger: float = 1.0,
    ) -> None:
        self.container = check_container(container)
        self.endpoint = endpoint
        self.user = user
        self.workdir = workdir
        self.env = dict(env or {})
        if poll_interval <= 0 or exit_wait < 0 or linger < 0:
            raise UsageError("docker poll_interval must be > 0, exit_wait and linger >= 0")
        self.poll_interval = poll_interval
        self.exit_wait = exit_wait
        self.linger = linger
        self._ok_once = False
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> DockerTransport:
        # the container name is case-sensitive: take it from the raw URI, not the
        # (lower-cased) host name
        netloc = urllib.parse.urlsplit(uri.raw).netloc
        user, _, container = netloc.rpartition("@")
        if not container:
            raise UsageError(f"{uri.raw!r}: missing container (docker://CONTAINER/PATH)")
        if ":" in container:
            raise UsageError(f"{uri.raw!r}: a container takes no port (docker://CONTAINER/PATH)")
        host = str(options.get("docker_host") or os.environ.get("DOCKER_HOST") or "")
        endpoint = parse_docker_host(host)
        if endpoint.host is not None:
            # the docker CLI speaks TLS with either of the first two set, and the Go SDK and
            # docker-py with the third too: wsync would send the same request (the exec's
            # env included) in clear text to a daemon set up for TLS
            for name in ("DOCKER_TLS_VERIFY", "DOCKER_TLS", "DOCKER_CERT_PATH"):
                if os.environ.get(name, "").strip():
                    raise UsageError(
                        f"{name} is set: TLS to the docker daemon is not supported (pull "
                        "through its unix socket on the docker host, or unset it)"
                    )
        extra = float_options(options, ("poll_interval", "exit_wait", "linger"), "docker_")
        return cls(
            urllib.parse.unquote(container),
            endpoint=endpoint,
            user=options.get("docker_user") or (urllib.parse.unquote(user) if user else None),
            workdir=options.get("dir"),
            env=options.get("env"),
            **extra,
        )

    @property
    def description(self) -> str:
        return f"docker://{self.container}"

    def __repr__(self) -> str:
        return f"DockerTransport({self.description}, endpoint={str(self.endpoint)!r})"

    # ------------------------------------------------------------------ plumbing

    def _wire_error(self, err: OSError) -> TransportError | SandboxUnreachable:
        if isinstance(err, PermissionError):
            return AuthFailed(
                f"{self.description}: permission denied on the docker daemon at "
                f"{self.endpoint} (is this user in the docker group?)"
            )
        if not self._ok_once:
            return SandboxUnreachable(
                f"{self.description}: cannot connect to the docker daemon at {self.endpoint} "
                f"({err.strerror or err}); is it running? (--docker-host, $DOCKER_HOST)"
            )
        return TransportError(f"{self.description}: {type(err).__name__}: {err}")

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _create(self, body: bytes) -> str:
        path = f"/containers/{urllib.parse.quote(self.container, safe='')}/exec"
        answer = await docker_http.request(self.endpoint, "POST", path, body)
        if answer.status == 201:
            return parse_exec_id(answer.body)
        if answer.status == 404:
            raise SandboxUnreachable(f"{self.description}: no such container ({_error(answer)})")
        if answer.status in (401, 403):
            raise AuthFailed(f"{self.description}: the docker daemon refused ({_error(answer)})")
        if answer.status == 409 and not self._ok_once:
            raise SandboxUnreachable(
                f"{self.description}: container not running ({_error(answer)})"
            )
        raise TransportError(f"{self.description}: exec create refused ({_error(answer)})")

    async def _inspect(self, exec_id: str) -> Inspect:
        answer = await docker_http.request(self.endpoint, "GET", f"/exec/{exec_id}/json")
        if answer.status != 200:
            raise TransportError(f"{self.description}: exec inspect refused ({_error(answer)})")
        return parse_inspect(answer.body)

    async def _kill(self, token: str, *, mark: bool) -> None:
        """Best effort: the daemon keeps an exec running after its connection went.

        ``mark``: the exec was abandoned before its stream ended, so its process may not
        exist yet (moby answers the start, then starts the process): the killer leaves
        the token's kill marker, which the wrapper obeys whenever it starts."""
        argv = ["/bin/sh", "-c", KILL_SCRIPT, "sh", token, *(["mark"] if mark else [])]
        try:
            async with asyncio.timeout(10.0) as scope:
                body = exec_create_body(argv, stdin=False, user=self.user)
                exec_id = await self._create(body)
                deadline = scope.when() or asyncio.get_running_loop().time() + 10.0
                await self._run(exec_id, None, 4096, deadline)
        except (TimeoutError, OSError, TransportError, SandboxUnreachable, ProtocolError) as err:
            log.debug("docker %s: kill of exec %s failed: %r", self.container, token[:8], err)

    # ---------------------------------------------------------------------- exec

    def _exec_body(self, what: str, argv: Sequence[str], *, stdin: bool) -> tuple[str, bytes]:
        """A fresh kill token and the create body that runs ``argv`` under the wrapper
        with it (what an exec and a channel share)."""
        if not argv:
            raise UsageError(f"{what} needs a non-empty argv")
        if self._closed:
            raise TransportError(f"{self.description}: transport is closed")
        token = secrets.token_hex(16)
        body = exec_create_body(
            [*EXEC_WRAPPER, *argv],
            stdin=stdin,
            env={**self.env, TOKEN_VAR: token},
            workdir=self.workdir,
            user=self.user,
        )
        return token, body

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        if max_output < 0:
            raise UsageError("max_output must be >= 0")
        token, body = self._exec_body("exec", argv, stdin=stdin is not None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        started = finished = ended = False
        try:
            async with asyncio.timeout_at(deadline):
                exec_id = await self._create(body)
                started = True
                result, finished = await self._run(exec_id, stdin, max_output, deadline)
                ended = True  # the stream ended: the process ran (or never can)
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except ProtocolError as err:
            raise TransportError(f"{self.description}: {err}") from None
        except OSError as err:
            raise self._wire_error(err) from None
        finally:
            if started and not finished:
                self._spawn(self._kill(token, mark=not ended))
        self._ok_once = True
        if result.notes:
            log.debug("docker %s exec notes: %s", self.container, "; ".join(result.notes))
        return result

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """``argv`` (under the exec wrapper) with stdin attached, its connection kept open
        (:class:`~wsync.transports.docker_channel.DockerChannel`)."""
        token, body = self._exec_body("open_channel", argv, stdin=True)
        created = False
        started: docker_http.Hijacked | docker_http.Answer | None = None
        try:
            async with asyncio.timeout(timeout):
                exec_id = await self._create(body)
                created = True
                path = f"/exec/{exec_id}/start"
                started = await docker_http.hijack(self.endpoint, path, START_BODY)
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except ProtocolError as err:
            raise TransportError(f"{self.description}: {err}") from None
        except OSError as err:
            raise self._wire_error(err) from None
        finally:
            if created and not isinstance(started, docker_http.Hijacked):
                self._spawn(self._kill(token, mark=True))
        if isinstance(started, docker_http.Answer):
            raise TransportError(f"{self.description}: exec start refused ({_error(started)})")
        self._ok_once = True

        def kill(mark: bool) -> None:
            self._spawn(self._kill(token, mark=mark))

        return DockerChannel(started, self.description, kill)

    async def _run(
        self, exec_id: str, stdin: bytes | None, max_output: int, deadline: float
    ) -> tuple[ExecResult, bool]:
        """Start, stream, inspect.  Returns the result and whether the command is known
        to be over (False: leftovers may run, the caller kills them)."""
        started = await docker_http.hijack(self.endpoint, f"/exec/{exec_id}/start", START_BODY)
        if isinstance(started, docker_http.Answer):
            raise TransportError(f"{self.description}: exec start refused ({_error(started)})")
        notes: list[str] = []
        if started.status == 200:
            notes.append("start answered 200 (no upgrade)")
        collector = ExecCollector(max_output)
        sender: asyncio.Task[None] | None = None
        stdin_error: list[str] = []
        try:
            collector.feed(started.leftover)
            if stdin is not None:
                sender = asyncio.create_task(_send_stdin(started.writer, stdin, stdin_error))
            try:
                held = await self._read(started.reader, collector, exec_id)
            except ConnectionResetError as err:
                # The daemon closes the connection once the command's output is done,
                # whether or not the command read all of its stdin; stdin it did not
                # read (even bytes already "sent", still in the kernel's buffers) makes
                # that close a reset.  Output queued before it is read in full (unix
                # sockets deliver it first), so with stdin attached a reset is the end
                # of the stream, checked like any EOF; without stdin it is a cut.
                if sender is None:
                    raise TransportError(f"{self.description}: stream reset: {err}") from None
                notes.append("reset after the command stopped reading stdin")
                held = None
        finally:
            if sender is not None and not sender.done():
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            await docker_http.close(started.writer)
        if stdin_error:
            notes.append(f"stdin not fully delivered: {stdin_error[0]}")
        if held is None:
            collector.eof()
        if collector.system_error is not None:  # held open or not: the daemon said it failed
            raise TransportError(f"{self.description}: daemon error: {collector.system_error}")
        if held is not None:
            notes.append("EOF held open after the command exited (a background child kept stdout)")
            return collector.result(held.exit_code, notes), False
        state = await self._exit_code(exec_id, deadline)
        if not state.finished:
            # Podman's compatible API and moby before 1.25 say ``"ExitCode": 0`` while the
            # command runs: a running command's code is none, never that 0
            what = "still null" if state.exit_code is None else "not final (still running)"
            notes.append(f"exit code {what} {self.exit_wait:.1f}s after EOF")
        code = state.exit_code if state.finished else None
        return collector.result(code, notes), state.finished

    async def _read(
        self, reader: asyncio.StreamReader, collector: ExecCollector, exec_id: str
    ) -> Inspect | None:
        """Read to EOF; None then.  While the stream is quiet inspect is asked: if the
        command has exited and the stream still has not ended ``linger`` seconds later,
        its state is returned instead (a background child holds the EOF)."""
        loop = asyncio.get_running_loop()
        exited: Inspect | None = None
        exited_at = 0.0
        while True:
            wait = self.poll_interval
            if exited is not None:
                wait = max(exited_at + self.linger - loop.time(), 0.0)
            try:
                async with asyncio.timeout(wait):
                    data = await reader.read(docker_http.READ_SIZE)
            except TimeoutError:
                if exited is not None:
                    return exited
                state = await self._inspect(exec_id)
                if state.finished:
                    exited, exited_at = state, loop.time()
                continue
            if not data:
                return None
            collector.feed(data)

    async def _exit_code(self, exec_id: str, deadline: float) -> Inspect:
        """Inspect until ``ExitCode`` is set, at most ``exit_wait`` seconds (and never past
        the call's deadline, which the caller's timeout enforces)."""
        loop = asyncio.get_running_loop()
        give_up = min(loop.time() + self.exit_wait, deadline)
        delay = 0.01
        while True:
            state = await self._inspect(exec_id)
            if state.finished or loop.time() + delay > give_up:
                return state
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def aclose(self) -> None:
        self._closed = True
        if self._background:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(12.0):
                    await asyncio.gather(*self._background, return_exceptions=True)


async def _send_stdin(writer: asyncio.StreamWriter, data: bytes, errors: list[str]) -> None:
    """Raw bytes into the hijacked connection, then a half-close: the only stdin EOF the
    Engine API has.  A command that exits without reading all of it is not an error.

    The bytes go through a duplicate of the socket, not through the stream's transport:
    when the daemon stops reading (the command exited) a write fails with EPIPE, and
    asyncio's transport would then tear the whole connection down, throwing away output
    that already arrived and was not yet read.  A failed write on the duplicate stays a
    note; the reading side goes on to the daemon's EOF.
    """
    loop = asyncio.get_running_loop()
    sock = writer.get_extra_info("socket")
    if sock is None:
        errors.append("no socket to write stdin to")
        return
    raw = sock.dup()
    try:
        raw.setblocking(False)
        view = memoryview(data)
        for start in range(0, len(view), STDIN_CHUNK):
            await loop.sock_sendall(raw, view[start : start + STDIN_CHUNK])
        raw.shutdown(socket.SHUT_WR)
    except (ConnectionError, OSError) as err:
        errors.append(f"{type(err).__name__}: {err}")
    finally:
        raw.close()
