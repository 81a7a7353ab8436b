"""Guest helpers for one pull: calls without an exec each (see :mod:`wsync.protocol.helper`).

A :class:`HelperPool` opens helpers lazily, one per call in flight at once (a pull's
calls are mostly one after another; the parallel chunk reads take a few), and keeps
them between calls.  What it returns is raw output for the envelope parser, exactly as
an exec's stdout would be: the pool proves nothing.

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

#: helpers that failed before their first answer after which the pool is off
_UNPROVEN_LIMIT = 2
#: bound on closing one helper
_CLOSE_S = 5.0


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
        size = min(size, transport.channel_limit)
        self._size = size
        self._slots = asyncio.Semaphore(max(1, size))
        self._idle: list[_Helper] = []
        self._unproven_failures = 0
        self._closed = False
        #: helpers started (each is one exec in the guest)
        self.opened = 0

    @property
    def usable(self) -> bool:
        return (
            self.transport.capabilities.channel
            and self._size > 0
            and not self._closed
            and self._unproven_failures < _UNPROVEN_LIMIT
        )

    async def run(
        self,
        argv: Sequence[str],
        nonce: str,
        *,
        gate: bool,
        timeout: float,
        limit: int,
        on_open: Callable[[], None] = lambda: None,
    ) -> bytes:
        """``argv``'s output through a helper, within ``timeout`` seconds (opening one
        included); at most ``limit`` bytes.  ``on_open`` hears of every helper started
        for the call (each is an exec in the guest), whether the call then succeeds."""
        async with self._slots:
            deadline = time.monotonic() + timeout
            worker = self._idle.pop() if self._idle else None
            good = False
            why = "cancelled"
            try:
                if worker is None:
                    channel = await self.transport.open_channel(helper.ARGV, timeout=timeout)
                    self.opened += 1
                    on_open()
                    worker = _Helper(channel)
                    log.debug("helper opened", helpers=self.opened)
                await worker.channel.send(helper.request(argv, nonce, gate=gate))
                splitter = helper.ResponseSplitter(nonce, limit)
                while not splitter.done:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransportTimeout(timeout)
                    data = await worker.channel.receive(left)
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
                if worker is not None and good and not self._closed:
                    self._idle.append(worker)
                elif worker is not None:
                    log.debug("helper closed", reason="pull over" if good else why)
                    if not worker.proven:
                        self._unproven_failures += 1
                        if not self.usable:
                            log.info("guest helpers off for this pull; one exec per call")
                    # a call that failed may still run in the guest: stop it now
                    await self._close(worker, abort=not good)

    @staticmethod
    async def _close(worker: _Helper, *, abort: bool = False) -> None:
        with contextlib.suppress(TimeoutError, TransportError):
            async with asyncio.timeout(_CLOSE_S):
                await worker.channel.aclose(abort=abort)

    async def aclose(self) -> None:
        """Close every idle helper (idempotent); a helper in use is closed by its call."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            await self._close(worker)
