"""A hostile guest for tests: the real ``local:`` guest, whose answers to chosen calls a
test replaces with its own.

The guest sees every request, so it knows the call's nonce and hash and can wrap whatever
it likes in a valid envelope: a forged answer passes every check of the envelope, and
only what wsync makes of the payload decides.  Exec only (no guest helper), so every call
is one exec whose script names the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

from wsync.protocol.callsh import SCRIPTS
from wsync.protocol.envelope import parse_envelope, render_envelope
from wsync.protocol.hashing import ALGORITHMS, PROBE_ALGORITHM, Algorithm
from wsync.transports.base import DEFAULT_MAX_OUTPUT, Capabilities, ExecResult
from wsync.transports.local import LocalTransport

_NAMES = {text: name for name, text in SCRIPTS.items()}


@dataclasses.dataclass(frozen=True)
class Call:
    """One guest call as the guest sees it."""

    #: probe, admit, status, read, ... (:data:`wsync.protocol.callsh.SCRIPTS`' keys)
    name: str
    nonce: str
    algorithm: str
    args: tuple[str, ...]

    def _algorithm(self) -> Algorithm:
        return PROBE_ALGORITHM if self.algorithm == "md5" else ALGORITHMS[self.algorithm]

    def envelope(self, payload: bytes, ok: bool = True) -> bytes:
        """``payload`` as this call's valid answer."""
        return render_envelope(self.nonce, payload, algorithm=self._algorithm(), ok=ok)

    def payload(self, result: ExecResult) -> bytes:
        """The real guest's answer's payload."""
        return parse_envelope(
            result.stdout, self.nonce, algorithm=self._algorithm(), max_length=1 << 30
        ).payload


#: given the call and a way to ask the real guest, the forged stdout, or None for the real
Forger = Callable[[Call, Callable[[], Awaitable[ExecResult]]], Awaitable[bytes | None]]


class ForgingTransport(LocalTransport):
    """``local:`` with the answers ``forge`` gives in place of the guest's."""

    capabilities: ClassVar[Capabilities] = dataclasses.replace(
        LocalTransport.capabilities, channel=False
    )

    def __init__(self, forge: Forger, **kw: Any) -> None:
        super().__init__(**kw)
        self.forge = forge

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        async def real() -> ExecResult:
            return await LocalTransport.exec(
                self, argv, stdin=stdin, timeout=timeout, max_output=max_output
            )

        name = _NAMES.get(argv[2]) if len(argv) > 8 and list(argv[:2]) == ["sh", "-c"] else None
        if name is None:
            return await real()
        out = await self.forge(Call(name, argv[5], argv[6], tuple(argv[8:])), real)
        if out is None:
            return await real()
        return ExecResult(stdout=out, stderr=b"", exit_status=0)
