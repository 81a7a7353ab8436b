"""A fault-injecting transport: every way the field reports saw exec lie.

:class:`ChaosTransport` wraps any transport and, per call, applies one fault
chosen either from a *failure map* (borg's ``chunkers/failing.py`` style: a
string such as ``"..HT.D"`` read one letter per call, then clean) or at random
with per-fault rates from a seeded RNG.  The faults are:

====  ==================  ======================================================
code  name                what the caller sees
====  ==================  ======================================================
``.``  clean              the real result
``H``  head-loss          stdout without its head (a random cut), exit 0
``T``  tail-loss          stdout without its tail: data after the exit frame
                          was dropped by a client that stopped at exit
``F``  fabricated-exit    the stream ends early with a made-up exit 0
``S``  stderr-merged      stderr-like bytes spliced into stdout
``A``  after-exit         extra bytes after the end of output
``B``  bit-flip           one bit of stdout inverted
``D``  drop               connection lost: ``TransportError`` (the command may
                          or may not have run)
``W``  hang               nothing until the deadline: ``TransportTimeout``
``Z``  zero-frames        no output at all, exit 0
``N``  no-exit            intact output, no exit status
====  ==================  ======================================================

Independently, ``ring=N`` models the Sprites pre-attach history ring: a call
*without stdin* keeps only the last N bytes of its output (deterministic, as in
the field report's table).  A call with stdin is gated and loses nothing, which
is exactly why wsync's read scripts wait for a stdin byte.  And ``flip=N`` models a
channel that corrupts at a constant rate per byte: every call's stdout gets one bit
flipped per N bytes on average, so large reads almost always fail and small ones pass.
``cap=N`` cuts every call's stdout after its first N bytes (a frame or buffer limit).
``text=1`` makes the channel a lossy text one, as SSE and JSON exec APIs are: stdout is
decoded as UTF-8 with replacement characters, NULs vanish and every line ends in CRLF;
the transport then declares itself not binary-safe, so wsync sends base64 lines.
``slow=S,slow_from=N`` is no fault but a backend that got slower: from call N on, every
exec answers honestly S seconds late (or times out if its deadline comes first), which
a client that learns its deadlines must follow instead of failing.
``bw=B`` is no fault either but a narrow link: every call's stdout crosses at B bytes
per second, one budget shared by all calls in flight as a link's capacity is (what picks
the compression level must tell it from a link that only answers late, ``slow``).

This lives in the package, not in the tests, so ``wsync demo`` and the test
suite exercise the same faults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence

from wsync.errors import TransportError, TransportTimeout, UsageError
from wsync.protocol.helper import DONE
from wsync.transports.base import DEFAULT_MAX_OUTPUT, Channel, ExecResult, Transport

FAULT_CODES = "HTFSABDWZN"
CLEAN = "."
NAMES = {
    ".": "clean",
    "H": "head-loss",
    "T": "tail-loss",
    "F": "fabricated-exit",
    "S": "stderr-merged",
    "A": "after-exit",
    "B": "bit-flip",
    "D": "drop",
    "W": "hang",
    "Z": "zero-frames",
    "N": "no-exit",
}
#: per-fault rate of the "all" preset: ~70% of calls come back clean
ALL_RATE = 0.035
_NOISE = b"tar: ./log: file changed as we read it\n"


@dataclasses.dataclass
class FaultPlan:
    """Which fault each call gets."""

    rates: dict[str, float] = dataclasses.field(default_factory=dict)
    failure_map: str = ""
    seed: int | None = None
    #: pre-attach ring size for calls without stdin (0: off)
    ring: int = 0
    #: how long a hang lasts at most before the timeout is raised, seconds
    hang: float = 1.0
    #: flip one bit per this many stdout bytes on average, in every call (0: off)
    flip: int = 0
    #: a lossy text channel (see the module docstring)
    text: bool = False
    #: seconds ``aclose`` spends blocked in a worker thread, as a hung name lookup
    #: or socket teardown does (0: off); makes the end of a pull slow on purpose
    close: float = 0.0
    #: every call's stdout cut after this many bytes (0: off)
    cap: int = 0
    #: execs from call number ``slow_from`` (0-based) on answer this many seconds late
    slow: float = 0.0
    slow_from: int = 0
    #: stdout of all calls together crosses at this many bytes per second (0: no limit)
    bw: float = 0.0

    def __post_init__(self) -> None:
        bad = set(self.failure_map) - set(FAULT_CODES + CLEAN)
        if bad or set(self.rates) - set(FAULT_CODES):
            raise UsageError(f"unknown fault code(s) in {self.failure_map!r} / {self.rates!r}")
        self._rng = random.Random(self.seed)  # noqa: S311 - fault schedules, not secrets
        self._calls = 0
        #: calls that went to a guest helper over a channel (the rest were execs)
        self.channel_calls = 0
        self.applied: dict[str, int] = {}
        self._link_free_at = 0.0

    async def carry(self, nbytes: int, timeout: float) -> None:
        """Wait while ``nbytes`` of stdout cross a ``bw`` link (shared by every call)."""
        if not self.bw or not nbytes:
            return
        now = time.monotonic()
        self._link_free_at = max(now, self._link_free_at) + nbytes / self.bw
        wait = self._link_free_at - now
        await asyncio.sleep(min(timeout, wait))
        if wait >= timeout:
            raise TransportTimeout(timeout)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse ``all``, ``none`` or ``K=V,...`` (codes, map, seed, ring, hang, close, slow...)."""
        plan: dict[str, object] = {"rates": {}}
        rates: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = item.partition("=")
            try:
                if key == "all":
                    rates.update(dict.fromkeys(FAULT_CODES, float(value or ALL_RATE)))
                    plan["ring"] = plan.get("ring") or 64 * 1024
                elif key == "none":
                    continue
                elif key == "map":
                    plan["failure_map"] = value
                elif key in ("seed", "ring", "flip", "cap", "slow_from"):
                    plan[key] = int(value)
                elif key in ("hang", "close", "slow", "bw"):
                    plan[key] = float(value)
                elif key == "text":
                    plan[key] = value not in ("", "0")
                elif key in FAULT_CODES:
                    rates[key] = float(value)
                else:
                    raise ValueError(key)
            except ValueError:
                raise UsageError(f"bad fault spec item {item!r} in {spec!r}") from None
        plan["rates"] = rates
        return cls(**plan)  # type: ignore[arg-type]

    @property
    def calls(self) -> int:
        """How many calls have drawn their fault so far."""
        return self._calls

    def next_fault(self) -> str:
        index = self._calls
        self._calls += 1
        if index < len(self.failure_map):
            return self.failure_map[index]
        roll = self._rng.random()
        for code, rate in self.rates.items():
            if roll < rate:
                return code
            roll -= rate
        return CLEAN

    def cut(self, n: int) -> int:
        return self._rng.randrange(n) if n > 0 else 0

    def flips(self, n: int) -> list[int]:
        """Offsets to corrupt in ``n`` bytes: a Poisson process of rate ``1/flip``."""
        found: list[int] = []
        if self.flip > 0:
            at = self._rng.expovariate(1 / self.flip)
            while at < n:
                found.append(int(at))
                at += self._rng.expovariate(1 / self.flip)
        return found

    def corrupt(self, data: bytes) -> bytes:
        """``data`` with the bits :attr:`flip` asks for flipped (``flip=N``)."""
        if not self.flip:
            return data
        flipped = bytearray(data)
        for at in self.flips(len(data)):
            flipped[at] ^= 1 << self.cut(8)
        return bytes(flipped)

    def flip_one(self, data: bytes) -> bytes:
        """``data`` with one bit flipped at random (the ``B`` fault)."""
        if not data:
            return data
        at = self.cut(len(data))
        return data[:at] + bytes([data[at] ^ (1 << self.cut(8))]) + data[at + 1 :]


class ChaosTransport(Transport):
    """Wrap ``inner`` and lie the way real backends were seen to lie."""

    scheme = "chaos"

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        caps = inner.capabilities
        if plan.text:  # an SSE or JSON exec API: text, and no live channel
            caps = dataclasses.replace(caps, binary_safe=False, channel=False)
        if plan.cap:  # a per-call frame limit belongs to one-shot execs
            caps = dataclasses.replace(caps, channel=False)
        self.capabilities = caps  # type: ignore[misc]

    @property
    def description(self) -> str:
        return f"{self.inner.description} (fault injection on)"

    async def aclose(self) -> None:
        if self.plan.close > 0:
            await asyncio.to_thread(time.sleep, self.plan.close)
        await self.inner.aclose()

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        plan = self.plan
        fault = plan.next_fault()
        plan.applied[fault] = plan.applied.get(fault, 0) + 1
        if fault == "W":
            await asyncio.sleep(min(timeout, plan.hang))
            raise TransportTimeout(min(timeout, plan.hang))
        if fault == "D" and plan.cut(2) == 0:
            raise TransportError("connection dropped before the command ran (injected)")
        if plan.slow and plan.calls > plan.slow_from:  # this call is number calls - 1
            await asyncio.sleep(min(timeout, plan.slow))
            if plan.slow >= timeout:
                raise TransportTimeout(timeout)
        result = await self.inner.exec(argv, stdin=stdin, timeout=timeout, max_output=max_output)
        out = result.stdout
        await plan.carry(len(out), timeout)
        if plan.ring and stdin is None and len(out) > plan.ring:
            out = out[-plan.ring :]
        if plan.cap:
            out = out[: plan.cap]
        status = result.exit_status
        if plan.text:
            text = out.decode("utf-8", "replace").replace("\0", "")
            out = text.replace("\r\n", "\n").replace("\n", "\r\n").encode()
        out = plan.corrupt(out)
        if fault == "D":
            raise TransportError("connection dropped mid-read (injected)")
        if fault == "H":
            out, status = out[plan.cut(len(out)) or 1 :], 0
        elif fault in ("T", "F"):
            out, status = out[: plan.cut(len(out))], 0
        elif fault == "S":
            at = plan.cut(len(out) + 1)
            out = out[:at] + (result.stderr or _NOISE) + out[at:]
        elif fault == "A":
            out = out + b"\x01late frame after exit"
        elif fault == "B":
            out = plan.flip_one(out)
        elif fault == "Z":
            out, status = b"", 0
        elif fault == "N":
            status = None
        notes = (*result.notes, f"chaos:{NAMES[fault]}") if fault != CLEAN else result.notes
        return dataclasses.replace(result, stdout=out, exit_status=status, notes=notes)

    async def read_file(self, path: str, offset: int, length: int, *, timeout: float) -> bytes:
        """The file API lies the same ways: cut bodies, flipped bits, drops and hangs."""
        plan = self.plan
        fault = plan.next_fault()
        plan.applied[fault] = plan.applied.get(fault, 0) + 1
        if fault == "W":
            await asyncio.sleep(min(timeout, plan.hang))
            raise TransportTimeout(min(timeout, plan.hang))
        if fault == "D":
            raise TransportError("file read dropped (injected)")
        data = await self.inner.read_file(path, offset, length, timeout=timeout)
        if fault in ("H", "T", "F", "Z"):
            data = data[: plan.cut(len(data))]
        elif fault in ("S", "A"):
            data = data + _NOISE
        elif fault == "B":
            data = plan.flip_one(data)
        return data

    @property
    def channel_limit(self) -> int:
        return self.inner.channel_limit

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """A channel that lies per request: see :class:`ChaosChannel`."""
        return ChaosChannel(await self.inner.open_channel(argv, timeout=timeout), self.plan)


class ChaosChannel(Channel):
    """Each :meth:`send` (one request to a guest helper) draws a fault, which lands on
    the first piece of the answer: ``H`` cuts its head, ``T``/``F`` its tail and then
    the channel ends, ``Z`` ends it at once, ``S`` adds bytes, ``B`` flips a bit,
    ``A`` adds bytes after the call's output (before the helper's end line),
    ``D`` drops the channel (before the request or mid-answer), ``W`` hangs until the
    deadline, ``N`` is clean (a channel has no exit status to lose).  ``flip``,
    ``slow`` and ``bw`` apply as they do to execs."""

    def __init__(self, inner: Channel, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self._fault = CLEAN
        self._first = False
        self._ended = False
        self._late = False

    async def send(self, data: bytes) -> None:
        plan = self.plan
        fault = self._fault = plan.next_fault()
        plan.applied[fault] = plan.applied.get(fault, 0) + 1
        plan.channel_calls += 1
        self._late = bool(plan.slow) and plan.calls > plan.slow_from
        if fault == "D" and plan.cut(2) == 0:
            self._ended = True
            raise TransportError("channel dropped before the request (injected)")
        await self.inner.send(data)
        self._first = True

    async def receive(self, timeout: float) -> bytes:
        plan, fault = self.plan, self._fault
        if self._ended:
            raise TransportError("channel dropped (injected)")
        if self._first and fault == "W":
            await asyncio.sleep(min(timeout, plan.hang))
            raise TransportTimeout(min(timeout, plan.hang))
        if self._first and self._late:
            self._late = False
            await asyncio.sleep(min(timeout, plan.slow))
            if plan.slow >= timeout:
                raise TransportTimeout(timeout)
        data = await self.inner.receive(timeout)
        await plan.carry(len(data), timeout)
        if data:
            data = plan.corrupt(data)
        if fault == "A" and self._first and DONE in data:
            # after the call's output, before the helper's end-of-answer line
            at = data.index(DONE)
            self._first = False
            return data[:at] + b"\x01late frame after exit" + data[at:]
        if not self._first or not data or fault == "A":
            return data
        self._first = False
        if fault == "D":
            self._ended = True
            raise TransportError("channel dropped mid-answer (injected)")
        # the fault lands on the call's own output, as it does on an exec's; the helper's
        # end line after it is the channel's framing (its damage is tested apart)
        end = data.find(DONE)
        out, rest = (data, b"") if end < 0 else (data[:end], data[end:])
        if fault == "H" and out:
            out = out[plan.cut(len(out)) or 1 :]
        elif fault in ("T", "F", "Z"):
            out, rest = (out[: plan.cut(len(out))] if fault != "Z" else b""), b""
            self._ended = True
        elif fault == "S":
            at = plan.cut(len(out) + 1)
            out = out[:at] + _NOISE + out[at:]
        elif fault == "B":
            out = plan.flip_one(out)
        return out + rest

    @property
    def ended(self) -> bool:
        return self._ended or self.inner.ended

    async def aclose(self, *, abort: bool = False) -> None:
        await self.inner.aclose(abort=abort)


def wrap(transport: Transport, spec: str | FaultPlan) -> ChaosTransport:
    plan = spec if isinstance(spec, FaultPlan) else FaultPlan.parse(spec)
    return ChaosTransport(transport, plan)
