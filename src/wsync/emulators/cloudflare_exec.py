"""One Bridge exec in the emulator: a bash process, its output pipeline, one SSE response.

Split from :mod:`wsync.emulators.cloudflare` (the server) because this is where the
channel's transforms and the stream faults happen: lossy UTF-8 decoding (always),
session-mode line framing, and the fault plan's cuts, hangs and made-up exits,
placed by output byte count or stream age.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import shlex
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wsync.emulators import cloudflare_http as http
from wsync.emulators.cloudflare_faults import ExecPlan
from wsync.emulators.sprites import end_process, kill_group
from wsync.transports.cloudflare_protocol import (
    ExecRequest,
    encode_error,
    encode_exit,
    encode_output,
    encode_outputs,
)

if TYPE_CHECKING:
    from wsync.emulators.cloudflare import CloudflareEmulator

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
#: pipes still held open by children are abandoned this long after the command exits
PIPE_GRACE = 1.0
#: the Bridge's grace between SIGTERM and SIGKILL on timeout
KILL_GRACE = 5.0

Item = tuple[str, Any]  # ("stdout"|"stderr", text) or ("exit", code)


def utf8_prefix(data: bytes, cut: int) -> bytes:
    """``data[:cut]`` moved back to a character boundary (the Bridge sends whole strings)."""
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return data[:cut]


class LineFramer:
    """Session-mode framing: one event per line plus ``"\\n"``; NULs dropped; long lines cut."""

    def __init__(self, emu: CloudflareEmulator, drop_long: bool) -> None:
        self.emu = emu
        self.drop_long = drop_long
        self.buf = ""

    def feed(self, text: str, final: bool) -> list[str]:
        self.buf += text.replace("\x00", "")
        *lines, self.buf = self.buf.split("\n")
        if final and self.buf:
            lines.append(self.buf)
            self.buf = ""
        return [self._line(line) for line in lines]

    def _line(self, line: str) -> str:
        limit = self.emu.faults.long_line_bytes
        if self.drop_long and len(line) > limit // 4:
            raw = line.encode()
            if len(raw) > limit:
                # the poller caught the line's first write; the rest has no prefix: gone
                self.emu.stats["dropped_fragments"] += 1
                line = utf8_prefix(raw, limit).decode()
        return line + "\n"


class ExecStream:
    """One ``POST .../exec``: a bash process, its output pipeline and one SSE response."""

    def __init__(
        self,
        emu: CloudflareEmulator,
        writer: asyncio.StreamWriter,
        req: ExecRequest,
        cwd: Path,
        plan: ExecPlan,
        session_mode: bool,
    ) -> None:
        self.emu = emu
        self.writer = writer
        self.req = req
        self.cwd = cwd
        self.plan = plan
        self.line_mode = session_mode or plan.line_mode or plan.drop_long_lines
        self.queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=64)
        self.proc: asyncio.subprocess.Process | None = None
        self.reading: set[str] = set()
        self.timed_out = False
        self.sent = 0
        self.runner: asyncio.Task[None] | None = None

    # -------------------------------------------------------------- process

    async def spawn(self) -> None:
        command = shlex.join(self.req.argv)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                "/bin/bash",
                "-c",
                command,
                cwd=self.cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as err:
            log.debug("cloudflare emulator: spawn failed: %s", err)
        else:
            self.emu.procs.add(self.proc)
        self.runner = asyncio.create_task(self.run_process())
        # tracked so that stop() ends it (a detached command may outlive its stream)
        self.emu.background.add(self.runner)
        self.runner.add_done_callback(self.emu.background.discard)

    async def pump(self, name: str, stream: asyncio.StreamReader) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        lines = LineFramer(self.emu, self.plan.drop_long_lines) if self.line_mode else None
        while True:
            self.reading.add(name)
            data = await stream.read(READ_SIZE)
            self.reading.discard(name)
            final = not data
            text = decoder.decode(data, final)
            pieces = lines.feed(text, final) if lines is not None else [text]
            pieces = [piece for piece in pieces if piece]
            if pieces:  # one queue item per read: a batch of events, written at once
                await self.queue.put((name, pieces))
            if final:
                return

    async def timer(self, proc: asyncio.subprocess.Process, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.timed_out = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.sleep(KILL_GRACE)
        kill_group(proc)

    async def run_process(self) -> None:
        proc = self.proc
        if proc is None:
            await self.queue.put(("stderr", ["bash: cannot execute\n"]))
            await self.queue.put(("exit", 127))
            return
        assert proc.stdout is not None and proc.stderr is not None
        pumps = {
            asyncio.create_task(self.pump("stdout", proc.stdout)): "stdout",
            asyncio.create_task(self.pump("stderr", proc.stderr)): "stderr",
        }
        timer = None
        if self.req.timeout_ms is not None:
            timer = asyncio.create_task(self.timer(proc, self.req.timeout_ms / 1000))
        loop = asyncio.get_running_loop()
        try:
            pending: set[asyncio.Task[None]] = set(pumps)
            exited_at: float | None = None
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.1)
                if not pending or proc.returncode is None:
                    continue
                exited_at = exited_at if exited_at is not None else loop.time()
                if loop.time() - exited_at >= PIPE_GRACE:
                    for task in pending:
                        if pumps[task] in self.reading:  # a detached child holds the pipe
                            task.cancel()
            code = await end_process(proc, kill=False)
        finally:
            for task in pumps:
                task.cancel()
            if timer is not None:
                timer.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        self.emu.procs.discard(proc)
        code = code if code >= 0 else 128 - code
        if self.timed_out:
            await self.queue.put(("stderr", [f"Command timed out after {self.req.timeout_ms}ms"]))
            code = 124
        await self.queue.put(("exit", code))

    async def kill(self) -> None:
        """The client went away or the stream failed: the command dies with it."""
        if self.proc is not None and self.proc.returncode is None:
            kill_group(self.proc)
        if self.runner is not None:
            # let the runner reap; it is bounded by PIPE_GRACE once the group is dead
            with contextlib.suppress(Exception):
                await self.void()

    async def void(self) -> None:
        """Consume output nobody will read until the command ends (after a made-up exit)."""
        while (await self.queue.get())[0] != "exit":
            pass

    # --------------------------------------------------------------- output

    async def write(self, data: bytes) -> None:
        pieces = [data]
        if self.plan.split and len(data) > 1:
            cuts = sorted(self.plan.rng.sample(range(1, len(data)), min(3, len(data) - 1)))
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        for piece in pieces:
            self.writer.write(http.chunk(piece))
            await self.writer.drain()

    async def sever(self, event: bytes) -> str:
        raw = http.chunk(event)
        self.writer.write(raw[: self.plan.rng.randrange(1, len(raw))])
        await self.writer.drain()
        self.writer.transport.abort()
        self.emu.stats["severed"] += 1
        return "severed"

    def next_fault(self) -> tuple[int, str] | None:
        plan = self.plan
        faults = [
            (at, kind)
            for at, kind in (
                (plan.early_exit_at, "early_exit"),
                (plan.hang_at, "hang"),
                (plan.sever_at, "sever"),
                (plan.error_at, "error"),
            )
            if at is not None
        ]
        return min(faults) if faults else None

    async def fire(self, kind: str, event: bytes | None) -> str:
        """A stream fault; returns how the response ends ("detach", "kill", "severed")."""
        plan = self.plan
        plan.early_exit_at = plan.hang_at = plan.sever_at = plan.error_at = None
        if kind == "early_exit":
            self.emu.stats["early_exit"] += 1
            self.writer.write(http.chunk(encode_exit(0)) + http.LAST_CHUNK)
            return "detach"
        if kind == "sever":
            return await self.sever(event or encode_exit(0))
        if kind == "error":
            self.emu.stats["error_event"] += 1
            self.writer.write(
                http.chunk(encode_error("Stream interrupted", "exec_transport_error"))
                + http.LAST_CHUNK
            )
            return "kill"
        self.emu.stats["hangs"] += 1
        await asyncio.Event().wait()  # until the client gives up
        raise AssertionError("unreachable")

    async def output(self, name: str, texts: list[str]) -> str | None:
        """Write one event per text, unless a fault's byte threshold falls inside them."""
        size = sum(len(text.encode()) for text in texts)
        fault = self.next_fault()
        if fault is None or fault[0] >= self.sent + size:
            await self.write(encode_outputs(name, texts))
            self.sent += size
            return None
        for text in texts:
            ending = await self.output_one(name, text)
            if ending is not None:
                return ending
        return None

    async def output_one(self, name: str, text: str) -> str | None:
        data = text.encode()
        fault = self.next_fault()
        if fault is not None and fault[0] < self.sent + len(data):
            head = utf8_prefix(data, fault[0] - self.sent)
            if head:
                await self.write(encode_output(name, head.decode()))
            self.sent += len(head)
            return await self.fire(fault[1], encode_output(name, data[len(head) :].decode()))
        await self.write(encode_output(name, text))
        self.sent += len(data)
        return None

    async def stream(self) -> str:
        """Write events until the exit; returns "keep", "detach", "kill" or "severed"."""
        plan, idle = self.plan, self.emu.faults.idle_close
        loop = asyncio.get_running_loop()
        cut_at = None if plan.early_exit_after is None else loop.time() + plan.early_exit_after
        held: tuple[str, Any] | None = None
        while True:
            wait = idle
            if cut_at is not None:
                wait = min(wait if wait is not None else 1e9, max(cut_at - loop.time(), 0.0))
            try:
                async with asyncio.timeout(wait):
                    kind, value = await self.queue.get()
            except TimeoutError:
                if cut_at is not None and loop.time() >= cut_at:
                    return await self.fire("early_exit", None)  # the command runs on
                self.emu.stats["idle_close"] += 1
                self.writer.write(http.LAST_CHUNK)
                return "kill"
            if kind != "exit":
                if plan.lose_tail:  # one event behind: the last one never goes out
                    previous, held = held, (kind, value)
                    if previous is None:
                        continue
                    kind, value = previous
                ending = await self.output(kind, value)
                if ending is not None:
                    return ending
                continue
            if held is not None:
                self.emu.stats["lost_tail"] += 1
            fault = self.next_fault()
            if fault is not None and fault[1] != "early_exit":
                return await self.fire(fault[1], encode_exit(value))
            if plan.no_exit:
                self.emu.stats["no_exit"] += 1
                self.writer.write(http.LAST_CHUNK)
                return "keep"
            if plan.zero_exit and value != 0:
                self.emu.stats["zero_exit"] += 1
                value = 0
            self.writer.write(http.chunk(encode_exit(value)) + http.LAST_CHUNK)
            return "keep"

    async def run(self, reader: asyncio.StreamReader) -> bool:
        """Serve the response; True if the connection can carry another request."""
        await self.spawn()
        gone = asyncio.create_task(reader.read(1))  # EOF: the client closed the connection
        streamer: asyncio.Task[str] | None = None
        ending = "kill"
        try:
            if self.plan.hang_before_headers:
                self.emu.stats["hangs"] += 1
                await gone
                return False
            self.writer.write(http.head(200, http.SSE_HEADERS))
            streamer = asyncio.create_task(self.stream())
            await asyncio.wait({gone, streamer}, return_when=asyncio.FIRST_COMPLETED)
            if not streamer.done():
                return False
            ending = streamer.result()
            return ending in ("keep", "detach", "kill")
        finally:
            gone.cancel()
            if streamer is not None and not streamer.done():
                streamer.cancel()
            await asyncio.gather(gone, *([streamer] if streamer else []), return_exceptions=True)
            if ending == "detach":
                task = asyncio.create_task(self.void())
                self.emu.background.add(task)
                task.add_done_callback(self.emu.background.discard)
            elif ending != "keep":
                await self.kill()
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()
