"""wsync's exception tree: one base, one exit code per class.

Every failure a user can meet is one of these.  Each class carries its process
exit code and a message template (borg's ``helpers/errors.py`` style), so the
CLI, the daemon's API and the JSON output all report the same thing:

====  =======================  ===============================================
code  class                    meaning
====  =======================  ===============================================
0     (success)                DEST holds exactly the guest's tree
1     InternalError            a bug in wsync; please report it (``--debug``)
2     UsageError               bad arguments or bad input (URI, DEST, config)
3     SandboxUnreachable       cannot connect, authenticate or find the sandbox
4     GuestToolsMissing        the guest lacks a shell, tar, or a hash tool
5     StagingFailed            the guest-side producer failed (disk full, ...)
6     IntegrityFailed          the bytes could not be verified after retries
7     HostileArchive           the archive tried to escape DEST or hit a limit
8     HostIOError              the host could not write DEST or the journal
24    UnstableFiles            files kept changing while the guest read them
130   Interrupted              stopped by a signal; the next run resumes
====  =======================  ===============================================

Foreign exceptions (OSError from a socket, asyncssh errors, websockets errors)
are translated at the transport boundary into :class:`TransportError` (a
retryable, per-call failure) or :class:`SandboxUnreachable` (fatal), the way
httpcore's ``map_exceptions`` does.  Nothing above the transports sees them.
"""

from __future__ import annotations

from typing import Any, ClassVar


class WsyncError(Exception):
    """Base of every error wsync reports.  ``str(err)`` is the one-line message."""

    exit_code: ClassVar[int] = 1
    kind: ClassVar[str] = "error"
    template: ClassVar[str] = "{}"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.args = args
        #: what the failed pull did so far (retries, faults, execs...), for its result
        self.so_far: dict[str, Any] = {}

    def __str__(self) -> str:
        return self.template.format(*self.args)


class InternalError(WsyncError):
    exit_code = 1
    kind = "internal"
    template = "internal error: {} (re-run with --debug and report this)"


class UsageError(WsyncError):
    exit_code = 2
    kind = "usage"


class Busy(UsageError):
    """Another pull holds this journal or DEST's lock.  Still a usage error (exit 2) for
    the CLI; a daemon fleet tells it apart to hand the job back instead of failing it
    (the holder may be a frozen daemon whose lease another one took over)."""

    kind = "busy"


class SandboxUnreachable(WsyncError):
    exit_code = 3
    kind = "unreachable"


class AuthFailed(SandboxUnreachable):
    kind = "auth"


class GuestToolsMissing(WsyncError):
    exit_code = 4
    kind = "guest-tools"
    template = "the guest lacks required tools: {}"


class StagingFailed(WsyncError):
    exit_code = 5
    kind = "staging"
    template = "guest-side staging failed: {}"


class ProducerVanished(StagingFailed):
    """The guest producer is gone without a ``done`` or ``failed`` record."""

    kind = "vanished"


class StagingGone(ProducerVanished):
    """The snapshot's staging is gone from the guest during the pull (``exists 0``), or
    a stream that came whole with its staging removed is not the one its index describes:
    where admissions remove the staging of what they carry whole, the pull starts afresh
    once without that (see :func:`wsync.engine.pull.pull`)."""


class ListMissing(StagingFailed):
    """A ``select`` run's admission found no uploaded list: the snapshot's staging went
    after the upload (a killed run's admission still removing it, a wiped ``/tmp``)."""


class IntegrityFailed(WsyncError):
    exit_code = 6
    kind = "integrity"
    template = "integrity not established: {}"


class HostileArchive(WsyncError):
    exit_code = 7
    kind = "hostile"
    template = "archive refused: {}"


class LimitExceeded(HostileArchive):
    kind = "limit"
    template = "archive refused, limit exceeded: {}"


#: what a refusal by an entry or byte limit tells the user to change (the hard caps, a
#: listing's size and a directory's names, have no knob)
FILES_KNOB = "--max-files; the daemon's limits.max_files"
BYTES_KNOB = "--max-bytes; the daemon's limits.max_bytes"


class HostIOError(WsyncError):
    exit_code = 8
    kind = "host-io"
    template = "host write failed: {}"


class DiskLow(HostIOError):
    """A write would take DEST's or the state directory's filesystem below the free-space
    reserve (``--min-free``): the host's condition, not the archive's, so the snapshot
    and the journal are kept and the same command resumes once there is room."""

    template = (
        "{}; make room, or lower the reserve with --min-free (the daemon's limits.min_free_bytes)"
    )


class DestReplaced(HostIOError):
    """DEST is not the directory the pull started from (another program put one there):
    it is left as it is, and is no longer taken for wsync's (see ``fsutil.swap_at``)."""

    template = "{}"


class HostOutOfMemory(HostIOError):
    """The host ran out of memory (a ``ulimit -v``, a container's limit): the snapshot is
    not at fault, so it is kept and the next run resumes it."""

    template = "the host ran out of memory {}; the journal is kept: run the pull again"


class HostOutOfFiles(HostIOError):
    """The host's open-file limit (``ulimit -n``) stops the pull: retrying cannot help,
    raising the limit does (the journal is kept)."""

    template = "too many open files on the host: {}; raise the limit (ulimit -n) and run again"


class UnstableFiles(WsyncError):
    """Files changed every time the guest read them: DEST would hold a version that never
    existed (a torn read), so the pull fails naming them, like rsync's exit 24.
    ``--best-effort`` takes them as last read instead."""

    exit_code = 24
    kind = "unstable"
    template = "files kept changing while the guest read them: {}"


class Interrupted(WsyncError):
    exit_code = 130
    kind = "interrupted"
    template = "interrupted: {}"


class Fenced(Interrupted):
    """A daemon's lease on its job ran out before the swap: another daemon may own the
    job now, so this one must not replace DEST (the journal stays for the new owner)."""

    kind = "fenced"


class ProtocolError(WsyncError):
    """Guest output that does not parse.  Always retryable: the channel lies.

    The protocol layer raises this and nothing else for bad input (fuzzed).
    """

    exit_code = 6
    kind = "protocol"
    template = "malformed guest output: {}"

    def __init__(self, message: str, fault: str = "malformed") -> None:
        super().__init__(message)
        #: what was detected, for metrics: "no-envelope" (head lost), "truncated",
        #: "trailer-mismatch" (bytes added or lost inside), "hash-mismatch", ...
        self.fault = fault


class TransportError(WsyncError):
    """One exec failed on the wire (dropped, reset, timed out).  Retryable."""

    exit_code = 6
    kind = "transport"
    template = "transport: {}"


class TransportTimeout(TransportError):
    kind = "timeout"
    template = "exec timed out after {:.1f}s"


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The most telling leaf of a TaskGroup failure (a WsyncError if any)."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                walk(sub)
        else:
            leaves.append(exc)

    walk(group)
    for leaf in leaves:
        if isinstance(leaf, WsyncError):
            return leaf
    return leaves[0]


EXIT_CODES: dict[int, str] = {
    0: "success: DEST holds exactly the guest's tree",
    1: "internal error (a bug; re-run with --debug)",
    2: "usage or bad input (or DEST, or a DEST around or inside it, is being pulled into)",
    3: "sandbox unreachable, not found, host key not verified, or authentication failed",
    4: "guest lacks required tools (sh, tar, ls, id, a hash tool, gzip/zstd)",
    5: "guest-side staging failed or refused (unsafe staging root, disk full, producer died, "
    "tar fatal error)",
    6: "integrity not established after retries (or the overall deadline passed)",
    7: "hostile archive refused, or an extraction limit exceeded",
    8: "host-side failure: a write (DEST, journal, state), free space below --min-free, "
    "memory, open files, or DEST replaced by another program during the pull",
    24: "files kept changing while read (DEST untouched; --best-effort takes them as read)",
    130: "interrupted; run the same command again to resume",
}
