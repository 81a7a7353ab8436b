"""Guest helpers for one pull: calls without an exec each (see :mod:`wsync.protocol.helper`).

A :class:`HelperPool` opens helpers lazily, one per call in flight at once (a pull's
calls are mostly one after another; the parallel chunk reads take a few), and keeps
them between calls.  A call that may wait (``reuse_wait``: any but a chunk read) first
waits that long for a busy helper to come free: opening one is an exec, a login shell
that a slow profile makes 100 ms and more, where the call it would wait for (a status
beside the next admission, say) takes a few ms.  What it
returns is raw output for the envelope parser, exactly as an exec's stdout would be: the
pool proves nothing.

Any failure (a deadline, a broken channel, a cut or flooded answer, a cancel) closes
that helper, whatever state it is in, and the call's retry starts a new one.  When
helpers keep failing before they ever answered (a guest without ``head``, a channel
the backend does not really stream), the pool turns itself off and the session goes
back to one exec per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import structlog

from wsync.errors import TransportError, TransportTimeout
from wsync.protocol import helper
from wsync.transports.base import Channel, Transport

log = structlog.get_logger("wsync.helpers")

#: failures in a row, before any helper answered, after which the pool is off (helpers
#: cannot run in this guest, or the channel does not stream)
_UNPROVEN_LIMIT = 2
#: failures in a row through helpers after which the pool is off even though helpers
#: have answered (a channel that keeps breaking: one exec per call is the safer way)
_FAILURE_LIMIT = 8
#: how long the end-of-answer line may lag behind the envelope's own last line before
#: it is taken as damaged (it follows at once: the script has exited)
_DONE_GRACE = 1.0
#: bound on closing one helper (longer than ssh's reaper: an abort runs one)
_CLOSE_S = 15.0


class _Helper:
    __slots__ = ("channel", "proven")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        #: answered at least one call completely
        self.proven = False


class HelperPool:
    """Up to ``size`` helpers over ``transport``; ``opened`` counts the execs they cost."""

    def __init__(self, transport: Transport, size: int) -> None:
        self.transport = transport
        # none where the transport has no channels
        size = min(size, transport.channel_limit) if transport.capabilities.channel else 0
        self._size = size
        self._slots = asyncio.Semaphore(max(1, size))
        self._idle: list[_Helper] = []
        #: calls waiting for a helper to come back to the idle list (woken all at once)
        self._waiting: list[asyncio.Future[None]] = []
        #: calls in progress (each holds a helper, or is about to open or wait for one)
        self._busy = 0
        self._answered = False
        self._failures = 0
        self._closed = False
        self._off = ""
        #: helpers started (each is one exec in the guest)
        self.opened = 0
        #: the closing of the helpers that were idle when the pool turned off
        self._letting_go: asyncio.Task[None] | None = None

    @property
    def usable(self) -> bool:
        return self._size > 0 and not self._closed and not self._off

    @property
    def _keeps(self) -> bool:
        """A helper whose call went well goes back to the idle list (else it is closed)."""
        return not self._closed and not self._off

    def turn_off(self, why: str) -> None:
        """One exec per call from now on.  The idle helpers go now, in a task that
        :meth:`aclose` waits for: each holds a process in the guest and, on a backend
        whose channel is a connection (E2B, Kubernetes), one the execs may need."""
        if not self._off:
            self._off = why
            log.info("guest helpers off for this pull; one exec per call", reason=why)
            idle, self._idle = self._idle, []
            if idle:
                self._letting_go = asyncio.get_running_loop().create_task(self._close_all(idle))

    def _take_idle(self) -> tuple[_Helper | None, list[_Helper]]:
        """An idle helper whose channel still stands, and the dead ones found on the way
        (a lost ssh connection ends them all; each would cost a call a retry)."""
        dead: list[_Helper] = []
        while self._idle:
            worker = self._idle.pop()
            if not worker.channel.ended:
                return worker, dead
            dead.append(worker)
        return None, dead

    async def run(
        self,
        argv: Sequence[str],
        nonce: str,
        *,
        gate: bool,
        timeout: float,
        limit: int,
        on_open: Callable[[], None] = lambda: None,
        reuse_wait: float = 0.0,
    ) -> bytearray:
        """``argv``'s output through a helper, within ``timeout`` seconds (opening one
        included); at most ``limit`` bytes.  ``on_open`` hears of every helper started
        for the call (each is an exec in the guest), whether the call then succeeds.
        With ``reuse_wait`` (seconds) and every helper busy, the call waits that long for
        one to come free before it opens another."""
        async with self._slots:
            deadline = time.monotonic() + timeout
            worker, dead = self._take_idle()
            good = False
            why = "cancelled"
            self._busy += 1  # (this call, from here to its end: what others may wait for)
            try:
                # the helper taken is this call's from here on: a cancel in any await below
                # reaches the finally, which closes it
                for gone in dead:
                    await self._close(gone, abort=True)
                if worker is None and reuse_wait > 0 and self._busy > 1:
                    worker = await self._wait_idle(min(reuse_wait, timeout / 2))
                if worker is None:
                    channel = await self.transport.open_channel(helper.ARGV, timeout=timeout)
                    self.opened += 1
                    on_open()
                    worker = _Helper(channel)
                    log.debug("helper opened", helpers=self.opened)
                # (bounded too: a channel whose send waits for the socket to drain, a
                # WebSocket's, must not outlive the call's deadline on a stalled peer)
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                        await worker.channel.send(helper.request(argv, nonce, gate=gate))
                except TimeoutError:
                    raise TransportTimeout(timeout) from None
                splitter = helper.ResponseSplitter(nonce, limit)
                grace: float | None = None
                while not splitter.done:
                    now = time.monotonic()
                    if splitter.answered and grace is None:
                        grace = now + _DONE_GRACE
                    left = min(deadline, grace or deadline) - now
                    if left <= 0 and grace is not None and deadline > now:
                        # the envelope is all there, its end line damaged: judge what came
                        why = "damaged end line"
                        return splitter.give_up()
                    if left <= 0:
                        raise TransportTimeout(timeout)
                    try:
                        data = await worker.channel.receive(left)
                    except TransportTimeout:
                        if grace is not None and deadline > time.monotonic():
                            continue
                        raise
                    if not data:
                        raise TransportError("the guest helper ended")
                    splitter.receive_data(data)
                worker.proven = True
                # bytes after the end of an answer: the channel is not as quiet as
                # lockstep says it must be, so that helper is not used again
                good = not splitter.leftover
                why = "bytes after the answer"
                return splitter.response
            except Exception as exc:
                why = type(exc).__name__
                raise
            finally:
                self._busy -= 1
                self._settle(worker, good, why)
                if worker is not None and not (good and self._keeps):
                    # a call that failed may still run in the guest: stop it now
                    await self._close(worker, abort=not good)

    async def _wait_idle(self, seconds: float) -> _Helper | None:
        """An idle helper within ``seconds``, or None (then the caller opens one).  Dead
        ones found meanwhile go back to the idle list, where the next taker closes them."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while True:
                    freed = loop.create_future()
                    self._waiting.append(freed)
                    try:
                        await freed
                    finally:
                        with contextlib.suppress(ValueError):
                            self._waiting.remove(freed)
                    worker, dead = self._take_idle()
                    self._idle.extend(dead)
                    if worker is not None:
                        return worker
        return None

    def _settle(self, worker: _Helper | None, good: bool, why: str) -> None:
        """Book the outcome of one call: the helper back to the idle list, or counted."""
        if worker is not None and worker.proven:
            self._answered = True
        if good:
            self._failures = 0
            if worker is not None and self._keeps:
                self._idle.append(worker)
                for freed in self._waiting:
                    if not freed.done():
                        freed.set_result(None)
            return
        if why == "cancelled":
            return  # not the helper's doing
        self._failures += 1
        log.debug("helper closed", reason=why)
        if not self._answered and self._failures >= _UNPROVEN_LIMIT:
            self.turn_off(f"no helper answered ({why})")
        elif self._failures >= _FAILURE_LIMIT:
            self.turn_off(f"{self._failures} helper calls in a row failed ({why})")

    @staticmethod
    async def _close(worker: _Helper, *, abort: bool = False) -> None:
        with contextlib.suppress(TimeoutError, TransportError):
            async with asyncio.timeout(_CLOSE_S):
                await worker.channel.aclose(abort=abort)

    async def _close_all(self, helpers: list[_Helper]) -> None:
        for worker in helpers:
            await self._close(worker)

    async def aclose(self) -> None:
        """Close every idle helper (idempotent); a helper in use is closed by its call."""
        self._closed = True
        while self._idle:
            await self._close(self._idle.pop())
        if self._letting_go is not None:
            # (wait, not await: a cancel of this call must not be taken for the task's)
            await asyncio.wait([self._letting_go])
