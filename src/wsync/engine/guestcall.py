"""The one retry loop of every guest call: render a script, run it, believe only envelopes.

:class:`GuestCalls` is where "never trust a single stream or an exit code" is enforced.
Each call gets a fresh nonce; its output is parsed as an envelope; anything short of a
complete, hash-verified envelope is a detected fault, counted by kind, and the call is
retried with jittered backoff.  The exit status is logged but never consulted.

What the calls say (probe, admission, status, reads, cleanup) is
:class:`~wsync.engine.guest.GuestSession`'s.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import secrets
import time
from collections.abc import Callable

import structlog

from wsync.engine.api import PullOptions
from wsync.engine.helpers import HelperPool
from wsync.engine.link import Link
from wsync.errors import IntegrityFailed, ProtocolError, TransportError, TransportTimeout
from wsync.protocol import records, scripts
from wsync.protocol.envelope import Envelope, EnvelopeParser, wire_length
from wsync.protocol.hashing import PROBE_ALGORITHM, Algorithm
from wsync.protocol.policy import backoff
from wsync.transports.base import Transport

log = structlog.get_logger("wsync.guest")

#: how long a call other than a chunk read waits for a busy guest helper to come free
#: before it opens another (an exec: a login shell, 100 ms and more with a slow profile)
_REUSE_WAIT = 0.1
#: a status poll's deadline before the pool of staged calls has learnt one, seconds
#: (plus its long poll; doubled per stall): status answers at once on any backend
_COLD_STATUS = 3.0
#: the same for the other calls of small, bounded work (see ``call``): the probe is the
#: first exec of a pull and may wake a suspended sandbox, so it is given longer; the
#: admission is not here (it measures the workspace, up to 20 s)
_COLD = {"status": _COLD_STATUS, "probe": 20.0, "cleanup": 5.0, "install": 5.0}
_GATE = b"\n"


@dataclasses.dataclass
class CallStats:
    transferred: int = 0
    #: commands run in the guest this run (every attempt of every call; file-API reads
    #: are not execs): what a slow shell profile or a costly exec multiplies
    execs: int = 0
    retries: int = 0
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class GuestCalls:
    """A session's calls into the guest: the retry loop and what every call shares."""

    def __init__(
        self,
        transport: Transport,
        options: PullOptions,
        stats: CallStats,
        helpers: HelperPool | None = None,
    ) -> None:
        self.transport = transport
        #: long-lived guest helpers that run calls without an exec each (None: off)
        self.helpers = helpers
        self.options = options
        self.stats = stats
        self.gate = transport.capabilities.stdin
        self.b64 = not transport.capabilities.binary_safe
        self.algorithm: Algorithm | None = None
        self.snapshot = ""
        #: the backend's file API is used for chunk reads (see read_direct)
        self.direct = transport.capabilities.file_read
        #: an exec may carry the admission that answers the first status too (see
        #: :meth:`admit`); else only a helper's request does
        self.long_argv = transport.capabilities.long_argv
        self._direct_failures = 0
        #: the staging root's physical path as the probe resolved and checked
        #: it; every later call uses this, never the configured value
        self.staging_root = ""
        #: what the admission measured (workspace size, free space), for the
        #: message of a full staging disk
        self.admission: records.AdmitReport | None = None
        #: the snapshot's first status, where the admission carried it (taken once)
        self.first_status: records.StatusReport | None = None
        #: identifies this run to the guest (admission retries are not adoptions)
        self.run_id = secrets.token_hex(8)
        #: the guest has ``base64`` (the probe says): lists may go in argv parts
        self._base64 = False
        self._gzip = False
        #: the producer's tools as the probe saw them (:func:`scripts.admit`)
        self._tools = scripts.NONE
        #: an admission of this pull has collected the stale snapshots
        self._collected = False
        self._rng = random.Random()  # noqa: S311 - backoff jitter, not a secret
        #: the link's rate, round trip and learnt deadlines (a hang costs seconds)
        self.link = Link(options.call_timeout, options.parallel)

    def via_helper(self, stdin: bytes = b"") -> bool:
        """Whether a call made now goes through a guest helper (whose requests travel on
        stdin: no argv limit of an exec endpoint applies).  A helper carries no stdin
        for a call (see :mod:`wsync.protocol.helper`)."""
        return self.helpers is not None and self.helpers.usable and not stdin

    def _wire(self, nonce: str) -> scripts.Wire:
        """The arguments every guest call after the probe shares."""
        assert self.algorithm is not None
        return scripts.Wire(
            gate=self.gate,
            nonce=nonce,
            algorithm=self.algorithm.name,
            b64=self.b64,
            staging_root=self.staging_root,
        )

    # -- the one retry loop ----------------------------------------------------

    async def call(
        self,
        what: str,
        build: Callable[[str], list[str]],
        *,
        max_length: int,
        algorithm: Algorithm | None = None,
        observe: Callable[[str | None, int], None] | None = None,
        asked: Callable[[], int] | None = None,
        stdin: bytes = b"",
        patience: float | Callable[[], float] = 0.0,
    ) -> Envelope:
        """Exec ``build(nonce)`` until a verified envelope comes back.

        ``observe`` hears the outcome of every attempt: None for success, or
        the fault kind, and how many bytes arrived (the read size listens here).
        ``asked`` tells the size the last attempt asked for, for the logs: every
        retry is logged at info level (``-v``) with its fault kind and that size,
        every exec at debug level (``--debug``) with its nonce, byte counts and
        duration, never the script text or its arguments.  Each attempt runs under a
        deadline the :class:`~wsync.engine.link.Link` learnt; one that stalls (ran out of a
        learnt deadline shorter than ``--call-timeout``) is retried with double the
        patience and does not count as an attempt.  ``patience`` is how long the script
        may wait on purpose (a long poll): it is added to the deadline and left out of
        what the deadlines learn; a callable is asked after each attempt's ``build``
        (an attempt may or may not wait, as its script was chosen).
        """
        last = "none"
        received = 0
        # reads and status polls answer at once from staged files: one pool to learn from
        # (a pull whose chunks go through a file API makes few exec reads of its own)
        kind = "staged" if what.startswith(("read ", "status")) else what.split(" ", 1)[0]
        # calls of small, bounded work get a deadline of seconds before their kind has
        # taught one (a status poll: a long poll makes few, and E2B's reads go through
        # its file API; the probe and the cleanup run once or twice a pull): a silent
        # stream there is given up as a stall, not after the whole call deadline (E2B:
        # 9.5 s of missed keepalives; Cloudflare: no keepalives at all)
        cold = _COLD.get(what)
        mode = "b64" if self.b64 else "raw"
        attempt = stalls = 0
        while attempt < self.options.max_attempts:
            attempt += 1
            nonce = secrets.token_hex(8)
            argv = build(nonce)
            waits = patience() if callable(patience) else patience
            #: the read size of this attempt, for the logs (reads only)
            size = {"asked": asked()} if asked is not None else {}
            bound = wire_length(max_length, mode) + 64 * 1024
            expect = wire_length(asked(), mode) if asked is not None else 0
            # a read shares the link: its deadline counts the reads that may share it, its
            # sample is its time alone (the meter's share clock)
            read = what.startswith("read ")
            learnt = self.link.deadline(kind, expect, stalls, cold, read=read)
            deadline = learnt + waits
            started = time.monotonic()
            share0 = self.link.clock(started, read=read)
            try:
                stdout: bytes | bytearray
                helpers = self.helpers
                if helpers is not None and self.via_helper(stdin):
                    stdout = await helpers.run(
                        argv,
                        nonce,
                        gate=self.gate,
                        timeout=deadline,
                        limit=bound,
                        on_open=self._count_exec,
                        # chunk reads run in parallel on purpose; any other call waits a
                        # moment for a busy helper rather than open one (an exec)
                        reuse_wait=0.0 if read else _REUSE_WAIT,
                    )
                    status: int | None = None
                    via = "helper"
                else:
                    self.stats.execs += 1
                    result = await self.transport.exec(
                        argv,
                        stdin=_GATE + stdin if self.gate else None,
                        timeout=deadline,
                        max_output=bound,
                    )
                    stdout, status, via = result.stdout, result.exit_status, "exec"
                self.stats.transferred += len(stdout)
                received = len(stdout)
                log.debug(
                    "guest call",
                    call=what,
                    attempt=attempt,
                    nonce=nonce,
                    via=via,
                    **size,
                    sent=sum(len(arg) for arg in argv),
                    received=received,
                    exit=status,
                    seconds=round(time.monotonic() - started, 3),
                )
                parser = EnvelopeParser(
                    nonce,
                    algorithm=algorithm or self.algorithm,
                    max_length=max_length,
                    allow_unhashed=algorithm is PROBE_ALGORITHM,
                )
                if isinstance(stdout, bytearray):  # a helper's answer: taken over, not copied
                    parser.receive_buffer(stdout)
                else:
                    parser.receive_data(stdout)
                del stdout  # (the parser holds what it needs)
                parser.receive_eof()
                envelope = parser.result()
                if envelope.noise or envelope.trailing:
                    self.stats.faults["extra-bytes"] += 1
                if observe is not None:
                    observe(None, received)
                self.link.answered(kind, received, started, share0, read=read, patience=waits)
                return envelope
            except ProtocolError as exc:
                last = exc.fault
                detail = str(exc)
            except TransportTimeout as exc:
                last, detail, received = "timeout", str(exc), 0
                if self.link.stalled(learnt):
                    last = "stall"
            except TransportError as exc:
                last, detail, received = "transport", str(exc), 0
            self.stats.retries += 1
            self.stats.faults[last] += 1
            if observe is not None:
                observe(last, received)
            log.info(
                "retry",
                call=what,
                attempt=f"{attempt}/{self.options.max_attempts}",
                fault=last,
                **size,
                received=received,
                seconds=round(time.monotonic() - started, 3),
                detail=detail[:200],
            )
            if last == "stall":  # not an attempt: the same one again, twice as patient
                attempt, stalls = attempt - 1, stalls + 1
            if attempt < self.options.max_attempts:
                await asyncio.sleep(backoff(attempt, rng=self._rng))
        raise IntegrityFailed(
            f"{what}: no verified answer after {self.options.max_attempts} attempts "
            f"(last fault: {last})"
        )

    def _count_exec(self) -> None:
        self.stats.execs += 1
