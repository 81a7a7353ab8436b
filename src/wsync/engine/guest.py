"""The calls a pull makes into the guest: probe, admission, producer install, list upload,
status, chunk reads and cleanup.

Each renders a script (:mod:`wsync.protocol.scripts`) and runs it through
:meth:`~wsync.engine.guestcall.GuestCalls.call`, the one retry loop that believes only a
complete, hash-verified envelope; each then parses the envelope's record
(:mod:`wsync.protocol.records`) and says what a refusal means in words.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import posixpath
import secrets
import time

import structlog

from wsync.digits import figure
from wsync.engine.guestcall import GuestCalls
from wsync.errors import (
    GuestToolsMissing,
    ListMissing,
    StagingFailed,
    StagingGone,
    UsageError,
    WsyncError,
)
from wsync.protocol import records, scripts
from wsync.protocol.hashing import ALGORITHMS, PROBE_ALGORITHM, PROBE_INPUT, Algorithm
from wsync.protocol.level import DEFAULT as DEFAULT_LEVEL
from wsync.protocol.policy import SIZE_FAULTS, ReadSizer

log = structlog.get_logger("wsync.guest")

_SMALL = 1024 * 1024  # bound for probe/admit/status answers
#: a short file-API answer is continued this many times before exec reads take over
_DIRECT_PIECES = 3
#: what the admission's script names in a word (its size is bounded: it travels in a
#: URL on some backends), said in full
_FAILED_WRITES = {
    "mkdir-failed": "cannot create the snapshot's staging directory",
    "token-failed": "cannot write the snapshot's admission token",
    "pid-failed": "cannot write the producer's pid file",
}
#: base64 text per list upload call through a guest helper or an exec whose argv may be
#: long (under Linux's 128 KiB per argument, with the script beside it)
_HELPER_UPLOAD_PART = 64 * 1024


def plain_root(root: str) -> str:
    """The probe's staging root, if it is a plain absolute path (no ``.``, ``..`` or empty
    parts): chunk paths are built from it, and an HTTP backend's file API puts them in a
    URL, where ``..`` from a hostile guest would aim the token at other routes."""
    if not root.startswith("/"):
        raise StagingFailed("the probe did not establish a staging root")
    if not root.isprintable():  # a NUL would end an exec's argument, a helper's shell drop it
        raise StagingFailed(f"the probe's staging root {root!r} holds a control character")
    if root.startswith("//") or posixpath.normpath(root) != root:
        raise StagingFailed(f"the probe's staging root {root!r} is not a plain absolute path")
    return root


@dataclasses.dataclass(frozen=True, slots=True)
class GuestPlan:
    """What the probe decided: how to talk to this guest."""

    algorithm: Algorithm
    compressor: str
    probe: records.ProbeReport


class GuestSession(GuestCalls):
    """The calls a pull makes, each verified by :meth:`GuestCalls.call`."""

    # -- the calls ---------------------------------------------------------------

    async def probe(self, workspace: str, *, free: bool = False) -> GuestPlan:
        """What the guest has; with ``free`` the staging root's free space too."""
        root = self.options.staging_root
        envelope = await self.call(
            "probe",
            lambda nonce: scripts.probe(
                gate=self.gate,
                nonce=nonce,
                b64=self.b64,
                workspace=workspace,
                staging_root=root,
                free=free,
            ),
            max_length=_SMALL,
            algorithm=PROBE_ALGORITHM,
        )
        if not envelope.ok:
            refusal = records.parse_stage_refusal(envelope.text)
            if refusal is not None and refusal.usage:
                raise UsageError(refusal.message)
            if refusal is not None:
                raise StagingFailed(refusal.message)
            if envelope.text == "workspace-missing":
                raise UsageError(f"workspace {workspace!r} does not exist in the sandbox")
            raise StagingFailed(f"probe: {records.printable(envelope.text)}")
        report = records.parse_probe(envelope.payload)
        if report.workspace == "missing":
            raise UsageError(f"workspace {workspace!r} does not exist in the sandbox")
        if report.workspace != "dir":
            raise UsageError(f"workspace {workspace!r} in the sandbox is not a readable directory")
        need = ["tar", "dd", "wc", "ls", "id"] + (["base64"] if self.b64 else [])
        missing = [tool for tool in need if not report.has(tool)]
        if report.has("dd") and not report.has("dd_bytes"):
            missing.append("dd with iflag=skip_bytes,count_bytes (GNU coreutils or busybox)")
        if missing:
            raise GuestToolsMissing(", ".join(missing))
        for algorithm in ALGORITHMS.values():
            if report.self_tests.get(algorithm.name) == algorithm.digest(PROBE_INPUT):
                break
        else:
            raise GuestToolsMissing("a working hash tool (xxhsum, b2sum or sha256sum)")
        order = ["zstd", "gzip"] if self.options.compressor == "zstd" else ["gzip", "zstd"]
        compressor = next((c for c in order if report.has(c)), None)
        if compressor is None:
            raise GuestToolsMissing("a compressor (zstd or gzip)")
        if compressor == "zstd" and report.has("zstd_long"):
            # a 32 MiB match window: a fifth fewer bytes on a source tree for ~10% more
            # guest CPU and 32 MiB of host memory (the decoder's window)
            compressor = "zstdl"
        self.staging_root = plain_root(report.stage_root)
        self.algorithm = algorithm
        self._base64 = report.has("base64")
        self._gzip = report.has("gzip")
        flags = (("g", "gnu_tar"), ("c", "find_cnewer"), ("p", "find_printf"), ("s", "tar_sort"))
        tools = "".join(flag for flag, tool in flags if report.has(tool))
        self._tools = tools or scripts.NONE
        if self.helpers is not None and not report.has("setsid"):
            # without setsid the producer would share a helper's process group, and an
            # aborted helper call would take it down (see wsync.protocol.helper)
            self.helpers.turn_off("the guest has no setsid")
        return GuestPlan(algorithm, compressor, report)

    async def admit(
        self,
        snapshot: str,
        workspace: str,
        compressor: str,
        *,
        level: int = DEFAULT_LEVEL,
        installed: bool = False,
        mode: str = "tar",
        prune: tuple[str, ...] = (),
        need_kb: int | None = None,
        status_wait: float | None = None,
        clean: bool = False,
    ) -> bool:
        """Start (or adopt) the snapshot's producer.  True when adopted.

        The guest runs the installed producer only if it hashes to ours; when
        it does not (or is missing) it is installed afresh, once.  ``need_kb``: the
        workspace's size from this run's listing (see :func:`scripts.admit`).  With
        ``status_wait``, the admission goes on as the first :meth:`status` from index
        offset 0 (long poll and small stream included), kept in :attr:`first_status`: a
        call less per producer run (a round trip of 0.1-0.3 s on the HTTP backends).  It
        is a few hundred bytes longer than the plain one: as an exec it goes only while it
        fits (:meth:`_exec_fits`), else the plain admission and a status call go.  With
        ``clean`` such a status that carries the finished stream whole also removes its
        staging (:attr:`records.StatusReport.cleaned`).
        """
        assert self.algorithm is not None
        self.snapshot = snapshot
        self.first_status = None
        producer_hash = self.algorithm.digest(scripts.PRODUCER.encode())
        looks = scripts.status_looks(status_wait) if status_wait is not None else -1
        inline = scripts.STATUS_INLINE_MAX if self._base64 else 0
        carried = [False]

        def render(nonce: str, carry: bool) -> list[str]:
            return scripts.admit(
                **self._wire(nonce),
                snapshot=snapshot,
                workspace=workspace,
                chunk_size=self.options.chunk_size,
                compressor=f"{compressor}:{level}",
                ttl_minutes=int(self.options.staging_ttl // 60),
                run=self.run_id,
                producer_hash=producer_hash,
                mode=mode,
                prune=prune,
                need_kb=need_kb,
                status_looks=looks if carry else -1,
                inline=inline if carry else 0,
                clean=clean,
                tools=self._tools,
                collect=not self._collected,
            )

        def build(nonce: str) -> list[str]:
            helped = self.via_helper()
            carried[0] = looks >= 0
            argv = render(nonce, carried[0])
            if carried[0] and not helped and not self._exec_fits(argv):
                # a long workspace path or many --exclude names: the plain admission, then
                # a status
                carried[0] = False
                argv = render(nonce, False)
            return argv

        envelope = await self.call(
            "admit",
            build,
            max_length=_SMALL,
            patience=lambda: scripts.looks_seconds(looks) if carried[0] else 0.0,
        )
        if not envelope.ok and envelope.text == "producer-missing" and not installed:
            await self.install_producer()
            return await self.admit(
                snapshot,
                workspace,
                compressor,
                level=level,
                installed=True,
                mode=mode,
                prune=prune,
                need_kb=need_kb,
                status_wait=status_wait,
                clean=clean,
            )
        if not envelope.ok:
            if envelope.text == "token-failed" and not (await self.status()).exists:
                # its directory went between the admission's steps: where an attempt of
                # this admission given up on (its answer lost) carried the stream whole and
                # removed it meanwhile, the pull starts afresh (see pull)
                raise StagingGone("the guest staging directory disappeared during the admission")
            self._admission_failed(envelope.text, workspace)
        self._collected = True  # the stale snapshots went with this admission
        answer, status = envelope.payload, b""
        if carried[0]:
            answer, _, status = answer.partition(b"\n")
        self.admission = records.parse_admit(answer)
        if status:
            self.first_status = self._status_report(status, 0)
        return self.admission.adopted

    def _exec_fits(self, argv: list[str]) -> bool:
        """Whether a long call (the admission that carries its status, an install part)
        may go as an exec: as a shell command line under :data:`scripts.EXEC_CARRY_MAX`
        where argv may be long, else in a URL's query under :data:`scripts.URL_ARGV_MAX`
        (Sprites, Kubernetes)."""
        if self.long_argv:
            return scripts.exec_length(argv) <= scripts.EXEC_CARRY_MAX
        return scripts.url_length(argv) <= scripts.URL_ARGV_MAX

    def _admission_failed(self, text: str, workspace: str) -> None:
        """Raise the error an ``err`` answer of the admission stands for."""
        if text == "workspace-missing":
            raise UsageError(f"workspace {workspace!r} does not exist in the sandbox")
        if text == "producer-missing":
            raise StagingFailed(
                "the producer script in the guest does not match its hash even after "
                "installing it afresh"
            )
        if text == "list-missing":
            raise ListMissing("the list of entries to archive is missing from the staging")
        if text == "unsafe-root":
            raise StagingFailed(
                f"the staging root {records.printable(self.staging_root)} is no longer a "
                "private directory of the pulling user"
            )
        if text in _FAILED_WRITES:
            where = records.printable(self.staging_root)
            raise StagingFailed(f"{_FAILED_WRITES[text]} in the guest's staging root {where}")
        word, *said = text.split(" ")
        if word == "disk-full" and len(said) == 2:
            free, need = figure(said[0]), figure(said[1])
            if free is not None and need is not None:
                raise StagingFailed(records.disk_full_message(free, self.staging_root, need))
        raise StagingFailed(records.printable(text))

    async def install_producer(self) -> None:
        """The producer script into the staging root, in parts (one call each): larger
        ones where an exec's argv may be long, and gzipped in base64 where the guest can
        decode it (plain again if that fails).  One size for the whole install, so that a
        helper given up on mid-way leaves parts its exec fallback still carries."""
        if self._base64 and self._gzip:
            size = scripts.INSTALL_PART_LONG if self.long_argv else scripts.INSTALL_PART_GZ64
            try:
                await self._install("gz64", size)
                return
            except StagingFailed as exc:
                log.info("compressed producer install failed; installing it plain", error=str(exc))
        size = scripts.INSTALL_PART_LONG if self.long_argv else scripts.INSTALL_PART
        await self._install("raw", size)

    def _install_size(self, encoding: str, size: int) -> int:
        """``size``, or smaller until every part's call fits the exec (:meth:`_exec_fits`:
        a long staging root takes room from the text); a helper's calls fit anyway, but a
        fallback to execs mid-way must carry the same parts."""
        nonce = secrets.token_hex(8)  # the length of every call's
        while size > scripts.BLOCK // 64:
            parts = range(scripts.install_parts(size, encoding))
            if all(self._exec_fits(self._install_argv(p, size, encoding, nonce)) for p in parts):
                break
            size = size * 3 // 4
        return size

    async def _install(self, encoding: str, size: int) -> None:
        assert self.algorithm is not None
        algorithm = self.algorithm
        size = self._install_size(encoding, size)
        installed = ""  # the last part's answer: the digest of the whole script
        for part in range(scripts.install_parts(size, encoding)):
            build = functools.partial(self._install_argv, part, size, encoding)
            envelope = await self.call("install", build, max_length=_SMALL)
            if not envelope.ok:
                raise StagingFailed(records.printable(envelope.text))
            installed = envelope.text
        if installed != algorithm.digest(scripts.PRODUCER.encode()):
            raise StagingFailed("the producer script arrived damaged in the guest")

    def _install_argv(self, part: int, size: int, encoding: str, nonce: str) -> list[str]:
        return scripts.install_producer(
            **self._wire(nonce), part=part, run=self.run_id, part_size=size, encoding=encoding
        )

    async def upload_list(self, snapshot: str, data: bytes) -> None:
        """Stage ``data`` (a NUL-separated name list) as the ``list`` of ``snapshot``.

        On stdin where the transport has it (one call, base64 on text channels), else in
        argv parts of base64 (Cloudflare, Daytona): 64 KiB each where an exec's argv may
        be long, else 4 KiB; the guest keeps it only when it hashes to ours, and the
        answer must name that hash too.
        """
        assert self.algorithm is not None
        digest = self.algorithm.digest(data)
        answers: list[str] = []
        # a helper carries no stdin (see wsync.protocol.helper): through one, the list
        # goes in argv parts as large as an exec may carry (under Linux's 128 KiB per
        # argument), so a fallback to execs mid-way still fits
        helped = self.helpers is not None and self.helpers.usable and self._base64
        if self.gate and not helped:
            body = base64.b64encode(data) if self.b64 else data
            envelope = await self.call(
                "upload",
                lambda nonce: scripts.upload(
                    **self._wire(nonce), snapshot=snapshot, how="stdin", digest=digest
                ),
                max_length=_SMALL,
                stdin=body,
            )
            answers.append(envelope.text)
            if not envelope.ok and envelope.text == "already-launched":
                return  # a resumed run: the list is in place and its producer started
            if not envelope.ok:
                raise StagingFailed(f"uploading the list: {records.printable(envelope.text)}")
        else:
            text = base64.b64encode(data).decode()
            # (a 1% change of a 59k-entry workspace is a 70 KB list in base64: 18 calls
            # of 4 KiB, seconds on an HTTP backend's round trips, or 2 of 64 KiB)
            size = _HELPER_UPLOAD_PART if helped or self.long_argv else scripts.UPLOAD_PART
            count = max(1, -(-len(text) // size))
            for part in range(count):
                piece = text[part * size : (part + 1) * size]
                envelope = await self.call(
                    "upload",
                    functools.partial(self._upload_argv, snapshot, part, count, piece, digest),
                    max_length=_SMALL,
                )
                if not envelope.ok and envelope.text == "already-launched":
                    return
                if not envelope.ok:
                    raise StagingFailed(f"uploading the list: {records.printable(envelope.text)}")
                answers.append(envelope.text)
        if answers[-1] != digest:
            raise StagingFailed("the list of entries arrived damaged in the guest")

    def _upload_argv(
        self, snapshot: str, part: int, count: int, text: str, digest: str, nonce: str
    ) -> list[str]:
        return scripts.upload(
            **self._wire(nonce),
            snapshot=snapshot,
            how="argv",
            part=part,
            parts=count,
            text=text,
            digest=digest,
        )

    async def status(
        self, index_from: int = -1, wait: float = 0.0, inline: int = 0
    ) -> records.StatusReport:
        """The snapshot's state; with ``index_from`` the index from there comes along,
        and with ``wait`` (seconds) the guest first waits that long at most for it to grow
        (a long poll: no exec, no round trip while the producer has nothing new).  With
        ``inline`` a finished stream up to that size comes along whole, where the guest
        has ``base64``."""
        assert self.algorithm is not None
        looks = scripts.status_looks(wait)
        inline = inline if self._base64 else 0
        envelope = await self.call(
            "status",
            lambda nonce: scripts.status(
                **self._wire(nonce),
                snapshot=self.snapshot,
                index_from=index_from,
                looks=looks,
                inline=inline,
            ),
            max_length=_SMALL,
            patience=scripts.looks_seconds(looks),
        )
        return self._status_report(envelope.payload, index_from)

    def _status_report(self, payload: bytes, index_from: int) -> records.StatusReport:
        """A status answer, parsed; a full disk told with the admission's figures."""
        assert self.algorithm is not None
        report = records.parse_status(payload, self.algorithm, index_from)
        if report.failed is not None and report.failed.startswith("disk-full "):
            # the producer found the disk full: say so with the admission's figures
            now = report.failed.split(" ")[1].rstrip(":")
            known = self.admission
            free = known.free_kb if known and known.free_kb is not None else None
            if free is None:
                free = figure(now) or 0
            message = records.disk_full_message(
                free, self.staging_root, known.need_kb if known else None
            )
            report = dataclasses.replace(report, failed=message)
        return report

    async def read(
        self, file: str, offset: int, length: int, sizer: ReadSizer | None = None
    ) -> bytes:
        """Read ``file[offset:offset+n]`` verified, where n ≤ ``length``.

        Without ``sizer`` exactly ``length`` bytes are read.  With it, every
        attempt asks for ``sizer.ask(length)`` bytes and reports how it
        went, so a read size that shrinks after a loss takes effect on the very
        next retry; the caller continues from ``offset + len(result)``.
        """
        assert self.algorithm is not None
        asked = [length]

        def build(nonce: str) -> list[str]:
            asked[0] = sizer.ask(length) if sizer is not None else length
            return scripts.read(
                **self._wire(nonce),
                snapshot=self.snapshot,
                file=file,
                offset=offset,
                length=asked[0],
            )

        def observe(fault: str | None, received: int) -> None:
            if sizer is None:
                return
            if fault is None:
                sizer.success(asked[0])
            elif fault in SIZE_FAULTS:
                # what the channel carried, in payload bytes (base64 is 4/3 of them)
                payload = received * 3 // 4 if self.b64 else received
                sizer.loss(asked[0], 0 if fault == "hash-mismatch" else payload)

        meter = self.link.meter
        began = time.monotonic()
        meter.begin(began)
        got = 0
        try:
            envelope = await self.call(
                f"read {file}@{offset}",
                build,
                max_length=length,
                observe=observe,
                asked=lambda: asked[0],
            )
            if not envelope.ok:
                raise StagingFailed(f"reading {file}: {records.printable(envelope.text)}")
            if len(envelope.payload) != asked[0]:
                raise StagingFailed(
                    f"reading {file}: asked {asked[0]} bytes, got {len(envelope.payload)}"
                )
            got = len(envelope.payload)
            return envelope.payload
        finally:
            meter.end(time.monotonic(), got, began)

    async def read_direct(self, offset: int, length: int, digest: str) -> bytes | None:
        """``data[offset:offset+length]`` through the backend's file API, or None.

        The fast path where the transport has one (``file_read``): one plain request
        instead of enveloped exec reads, believed only when it hashes to ``digest`` (the
        guest index's value for the chunk).  Any failure returns None and the caller
        falls back to exec reads; after two failures in a row that were not mere
        corruption (the API refuses the path, e.g. outside what it serves) the fast
        path is off for the rest of the session.
        """
        if not self.direct or self.algorithm is None:
            return None
        path = scripts.snapshot_dir(self.staging_root, self.snapshot) + "/data"
        link = self.link
        started = time.monotonic()
        link.meter.begin(started)
        share0 = link.clock(started, read=True)
        data = b""
        try:
            data = await self.transport.read_file(
                path,
                offset,
                length,
                timeout=link.read_deadline("file", length),
            )
            # a short answer (a body cut part-way, a short read): ask for the rest, a
            # few times; the hash below judges the whole, however many pieces it took
            for _ in range(_DIRECT_PIECES):
                if not data or len(data) >= length:
                    break
                need = length - len(data)
                more = await self.transport.read_file(
                    path,
                    offset + len(data),
                    need,
                    timeout=link.read_deadline("file", need),
                )
                self.stats.faults["file-api-short"] += 1
                if not more:
                    break
                data += more
        except (WsyncError, NotImplementedError) as exc:
            # a fast path never ends a pull, whatever the file API says (even 401:
            # a token scoped to exec only); exec reads are the fallback
            log.info("file API read failed", fault="file-api-failed", asked=length)
            self.stats.faults["file-api-failed"] += 1
            self._direct_failures += 1
            if self._direct_failures >= 2 or isinstance(exc, NotImplementedError):
                log.info("file API off for this pull; exec reads only", error=str(exc))
                self.direct = False
            return None
        finally:
            link.meter.end(time.monotonic(), len(data), started)
        self.stats.transferred += len(data)
        if len(data) != length or self.algorithm.digest(data) != digest:
            log.info("file API read damaged", fault="file-api-mismatch", asked=length)
            self.stats.faults["file-api-mismatch"] += 1
            return None
        self._direct_failures = 0
        link.deadlines.observe("file", length, link.clock(time.monotonic(), read=True) - share0)
        return data

    async def cleanup(self, *snapshots: str) -> None:
        """Remove ``snapshots`` (by default the session's) from the guest staging, in one
        call.  Named once, here: a retry removes the same ones even if the session has
        moved on to the next run's snapshot meanwhile (a cleanup may overlap the next
        admission)."""
        assert self.algorithm is not None
        targets = snapshots or (self.snapshot,)
        envelope = await self.call(
            "cleanup",
            lambda nonce: scripts.cleanup(**self._wire(nonce), snapshots=targets),
            max_length=_SMALL,
        )
        if not envelope.ok:
            raise StagingFailed(records.printable(envelope.text))
