"""Parsers for the small records guest scripts print inside envelopes.

All of them are line-oriented ``key value`` text written by wsync's own guest
scripts; values that come from the guest (tar's stderr, a failure reason) are
untrusted text and are only ever shown after :func:`printable`.  Every parser
raises :class:`~wsync.errors.ProtocolError` on anything unexpected.

The index is special: it is an append-only file in the guest, read in byte
ranges as it grows, so :class:`IndexParser` is incremental, accepts only whole
lines, and checks that chunks are contiguous (seq n+1 starts where n ended).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Collection

from wsync.digits import figure
from wsync.errors import ProtocolError
from wsync.protocol.hashing import Algorithm, is_hex

#: the bytes of a record's key: ASCII letters, digits and ``_``
_KEY_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
#: status fields the guest's text fills (see :func:`parse_fields`)
_FREE_STATUS = frozenset({"failed"})


def printable(text: str | bytes, limit: int = 300) -> str:
    """Make guest-provided text safe to show on one terminal line."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("…" if len(text) > limit else "")


def parse_fields(payload: bytes, free: Collection[str] = ()) -> dict[str, str]:
    """``key value`` lines → dict; keys are ``[a-z0-9_]+``, the value may hold spaces.

    Lines end at ``\n`` only.  The values of the keys in ``free`` are the guest's own words
    (a failure message that names a file, cut at a byte count): any bytes but a newline,
    undecodable ones shown escaped.  Refusing them would refuse the record that says a run
    failed, on every run after it: nothing would ever learn it failed and start afresh.
    Every other value must be UTF-8.
    """
    fields: dict[str, str] = {}
    for line in payload.split(b"\n"):
        if not line:
            continue
        raw_key, _, raw_value = line.partition(b" ")
        if not raw_key or not all(c in _KEY_BYTES for c in raw_key):
            raise ProtocolError(f"bad record line {printable(line, 60)!r}", "malformed")
        key = raw_key.decode("ascii")
        if key in free:
            fields[key] = raw_value.decode("utf-8", "backslashreplace")
            continue
        try:
            fields[key] = raw_value.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"record field {key!r} is not UTF-8", "malformed") from None
    return fields


def _int(fields: dict[str, str], key: str) -> int:
    value = fields.get(key, "")
    number = figure(value)
    if number is None:
        raise ProtocolError(f"record field {key!r} is not a number: {printable(value, 40)!r}")
    return number


# -- probe -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeReport:
    workspace: str  # "dir", "notdir", "missing", "unreadable"
    tools: frozenset[str]
    #: algorithm name → the guest tool's output on the probe input
    self_tests: dict[str, str]
    tar_version: str
    stage_free_kb: int | None
    uid: str
    #: the staging root's physical path, created and checked by the probe
    #: ("" when the probe did not get that far: no workspace, or no ``ls``)
    stage_root: str = ""

    def has(self, tool: str) -> bool:
        return tool in self.tools


#: GNU tar's ``--version`` line; ``--sort=name`` came with 1.28 (2014)
_GNU_TAR = re.compile(r"\(GNU tar\) ([0-9]{1,4})\.([0-9]{1,4})")


def tar_sorts(version: str) -> bool:
    """Whether the tar of this ``--version`` line reads directories in name order when
    asked (``--sort=name``, GNU tar 1.28 and later).  In name order a module sits beside
    its compiled forms: the standard library's archive is 7% smaller at the same zstd
    level for the same CPU (issue 13).  Anything else (busybox, an older or unknown tar,
    a wrapper's noise on the first line) keeps the directories' own order."""
    found = _GNU_TAR.search(version)
    return found is not None and (int(found[1]), int(found[2])) >= (1, 28)


def parse_probe(payload: bytes) -> ProbeReport:
    fields = parse_fields(payload)
    if fields.get("proto") != "1":
        raise ProtocolError("probe: unknown protocol version", "malformed")
    tools = frozenset(k[4:] for k, v in fields.items() if k.startswith("has_") and v == "1")
    if "gnu_tar" in tools and tar_sorts(fields.get("tar_version", "")):
        # decided here from the line the probe sends anyway: its script is at the bound
        # of a URL-borne argv (test_every_guest_call_fits_a_url_based_exec_endpoint)
        tools |= {"tar_sort"}
    tests = {k[5:]: v.split(" ")[0] for k, v in fields.items() if k.startswith("test_") and v}
    free = fields.get("stage_free_kb", "")
    return ProbeReport(
        workspace=fields.get("workspace", "missing"),
        tools=tools,
        self_tests=tests,
        tar_version=printable(fields.get("tar_version", ""), 120),
        stage_free_kb=figure(free),
        uid=printable(fields.get("uid", ""), 20),
        stage_root=fields.get("stage_root", ""),
    )


def human(kib: int) -> str:
    """KiB → a short human figure ("1.9 MiB")."""
    size = float(kib)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "KiB" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def disk_full_message(free_kb: int, path: str, need_kb: int | None) -> str:
    """The one shape every full-staging-disk failure is reported in (issue 7, item 12)."""
    need = f"needs about {human(need_kb)}" if need_kb is not None else "needs more"
    where = printable(path, 200)
    return f"guest staging disk full: {human(free_kb)} free at {where}, the workspace {need}"


@dataclasses.dataclass(frozen=True, slots=True)
class StageRefusal:
    """Why the probe refused the staging root; ``usage`` refusals are the
    user's to fix (exit 2), the others are the guest's state (exit 5)."""

    usage: bool
    message: str


def parse_stage_refusal(text: str) -> StageRefusal | None:
    """The probe's ``err`` answers about the staging root, or None for others.

    Shape: a first line ``KIND [numbers...]``, then one path per line.
    """
    head, *paths = text.split("\n")
    kind, *nums = head.split(" ")
    path = printable(paths[0], 200) if paths else "?"
    if kind == "inside" and len(paths) == 2:
        return StageRefusal(
            True,
            f"the staging root {path} and the workspace {printable(paths[1], 200)} overlap "
            "(one is inside the other); pass --staging-dir outside the workspace",
        )
    hint = "; refusing to stage there (remove it, or pass --staging-dir)"
    if kind == "owner" and len(nums) >= 2:
        name = printable(nums[2], 40) if len(nums) > 2 else "?"
        return StageRefusal(
            False,
            f"staging root {path} is owned by {name} (uid {printable(nums[0], 12)}), "
            f"not by the pulling user (uid {printable(nums[1], 12)}){hint}",
        )
    if kind == "writable" and nums:
        mode = printable(nums[0], 12)
        return StageRefusal(
            False, f"staging root {path} is writable by other users (mode {mode}){hint}"
        )
    if kind == "ancestor" and len(nums) >= 2:
        owner, mode = printable(nums[0], 12), printable(nums[1], 12)
        return StageRefusal(
            False,
            f"{path}, a parent of the staging root, is owned by uid {owner} with mode "
            f"{mode}: another user could replace what lies beneath it{hint}",
        )
    if kind == "symlink":
        return StageRefusal(False, f"staging root {path} is a symlink{hint}")
    if kind == "notdir":
        return StageRefusal(False, f"staging root {path} is not a directory{hint}")
    if kind == "create":
        return StageRefusal(False, f"cannot create the staging root {path}")
    return None


# -- admission ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class AdmitReport:
    #: an existing snapshot of another run was adopted (``reconciled``)
    adopted: bool
    #: the workspace size and the staging root's free space when the snapshot
    #: was admitted, KiB (None when the guest could not measure them)
    need_kb: int | None = None
    free_kb: int | None = None


def parse_admit(payload: bytes) -> AdmitReport:
    """``admitted|reconciled [NEED_KB FREE_KB]``."""
    word, *figures = payload.strip().split(b" ")
    if word not in (b"admitted", b"reconciled") or len(figures) > 2:
        raise ProtocolError(f"admit: unexpected answer {printable(payload, 60)!r}", "malformed")
    numbers = [figure(f) for f in figures]
    numbers += [None] * (2 - len(numbers))
    return AdmitReport(word == b"reconciled", numbers[0], numbers[1])


# -- status ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DoneRecord:
    chunks: int
    length: int
    digest: str
    tar_rc: int
    comp_rc: int
    #: sizes of the guest's NUL-separated lists of files that never stopped
    #: changing while read, and of files that vanished after a first read
    unstable_bytes: int = 0
    gone_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StatusReport:
    exists: bool
    alive: bool
    launched: bool
    index_size: int
    data_size: int
    done: DoneRecord | None
    failed: str | None
    tar_errors: str
    #: the index from the offset the status was asked for (``b""`` when not asked, or
    #: nothing is there yet): one exec fewer per poll that finds new chunks
    index_tail: bytes = b""
    #: a small finished stream, whole (``scripts.status``'s ``inline``): unverified here;
    #: each chunk of it counts only once it hashes to the index's digest, as a read's
    inline: bytes | None = None
    #: the guest removed the snapshot's staging after it sent ``inline`` (an admission's
    #: status asked to: ``scripts.admit``'s ``clean``): nothing is left there to read
    cleaned: bool = False


TAR_ERR_MARK = "tar_err_follows"
INDEX_MARK = b"\nindex_follows\n"


def parse_status(payload: bytes, algorithm: Algorithm, index_from: int = -1) -> StatusReport:
    """The status script's answer; ``index_from`` is the offset its index tail was asked
    from (a tail from anywhere else is refused)."""
    index_tail = b""
    before, marked, after = payload.partition(INDEX_MARK)
    if marked:
        fields = parse_fields(before, _FREE_STATUS)
        size = _int(fields, "index_tail")
        if index_from < 0 or _int(fields, "index_from") != index_from or len(after) < size:
            raise ProtocolError("status: an index tail that was not asked for", "malformed")
        index_tail, rest = after[:size], after[size:]
        if rest and not rest.startswith(b"\n"):
            raise ProtocolError("status: bytes after the index tail", "malformed")
        payload = before + rest
    head, sep, tail = payload.partition(b"\n" + TAR_ERR_MARK.encode() + b"\n")
    fields = parse_fields(head, _FREE_STATUS)
    if fields.get("exists") != "1":
        return StatusReport(False, False, False, 0, 0, None, None, "")
    done = None
    if fields.get("done_chunks") is not None:
        digest = fields.get("done_hash", "")
        if not is_hex(digest, algorithm.hex_len):
            raise ProtocolError("status: bad whole-stream hash in done record")
        done = DoneRecord(
            chunks=_int(fields, "done_chunks"),
            length=_int(fields, "done_length"),
            digest=digest,
            tar_rc=_int(fields, "done_tar_rc"),
            comp_rc=_int(fields, "done_comp_rc"),
            unstable_bytes=_int(fields, "done_unstable_bytes"),
            gone_bytes=_int(fields, "done_gone_bytes"),
        )
    failed = fields.get("failed")
    data_size = _int(fields, "data_size")
    return StatusReport(
        exists=True,
        alive=fields.get("alive") == "1",
        launched=fields.get("launched") == "1",
        index_size=_int(fields, "index_size"),
        data_size=data_size,
        done=done,
        failed=printable(failed.strip()) if failed is not None else None,
        tar_errors=printable(tail, 2000) if sep else "",
        index_tail=index_tail,
        inline=_inline(fields.get("data_b64"), data_size),
        cleaned=fields.get("cleaned") == "1",
    )


def _inline(text: str | None, size: int) -> bytes | None:
    """The stream a status carried whole; None where it carried none or one that does not
    decode to ``data_size`` bytes (the chunks are then read as any others: a guest whose
    ``base64`` misbehaves costs the reads it would have saved, never the pull)."""
    if text is None:
        return None
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return data if len(data) == size else None


def parse_name_list(payload: bytes) -> list[bytes]:
    """Names from one of the producer's NUL-separated lists (``./a/b`` → ``a/b``).

    The list is verified guest output but the guest is hostile: names are only ever used
    through confined, no-follow lookups, and ones that could not name an entry (empty,
    absolute, ``..``) are dropped here.
    """
    names = []
    for raw in payload.split(b"\0"):
        name = raw[2:] if raw.startswith(b"./") else raw
        parts = name.split(b"/")
        if not name or name.startswith(b"/") or b".." in parts or name == b".":
            continue
        names.append(name)
    return names


# -- the chunk index ---------------------------------------------------------

#: the first chunk's length; each next one is four times the last, up to the snapshot's
#: chunk size.  The host starts extracting when the first chunk is in: with whole 4 MiB
#: chunks that came half a second into a first pull (tar and zstd had to make ~20 MB of
#: archive first), while the plain stream was already writing files (issue 13).  Growing
#: by four, not two, keeps the extra chunks at two: where every read is an exec of its
#: own, each costs one, and a backend's per-exec faults with it
FIRST_CHUNK = 256 * 1024
#: past this many steps every chunk has the snapshot's chunk size: the largest length
#: the guest's shell computes is 256 MiB (the chunk size's upper bound), which a shell
#: with 32-bit arithmetic holds too
GROWTH_STEPS = 6
#: the whole schedule, in a journal's resume key: a journal cut by another (an older
#: wsync's) starts a fresh snapshot rather than fail on its index
CHUNK_SCHEDULE = f"{FIRST_CHUNK}x4^<{GROWTH_STEPS}"


def chunk_length(seq: int, chunk_size: int) -> int:
    """The length of chunk ``seq`` of a snapshot cut at ``chunk_size``: only the last
    chunk may be shorter.  The producer cuts by the same rule (``index_upto``)."""
    if seq >= GROWTH_STEPS:
        return chunk_size
    return min(chunk_size, FIRST_CHUNK << (2 * seq))


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    seq: int
    offset: int
    length: int
    digest: str


class IndexParser:
    """Incremental parser of the append-only index: ``C <seq> <off> <len> <hash>`` lines."""

    def __init__(self, algorithm: Algorithm, max_chunk: int) -> None:
        """``max_chunk`` is the snapshot's chunk size: every chunk but the last is as
        long as :func:`chunk_length` says."""
        self._algorithm = algorithm
        self._max_chunk = max_chunk
        self._partial = b""
        #: bytes of the index consumed so far (what to ask for next)
        self.consumed = 0
        self.next_seq = 0
        self.next_offset = 0
        self._short_seen = False

    def receive_data(self, data: bytes) -> list[Chunk]:
        """Feed the next bytes of the index file; return the chunks now complete."""
        self.consumed += len(data)
        buf = self._partial + data
        *lines, self._partial = buf.split(b"\n")
        if len(self._partial) > 512:
            raise ProtocolError("index line too long", "malformed")
        return [self._line(line) for line in lines]

    def _line(self, line: bytes) -> Chunk:
        parts = line.split(b" ")
        if len(parts) != 5 or parts[0] != b"C" or not all(p.isdigit() for p in parts[1:4]):
            raise ProtocolError(f"bad index line {printable(line, 80)!r}", "malformed")
        seq, offset, length = (int(p) for p in parts[1:4])
        digest = parts[4].decode("ascii", "replace")
        if seq != self.next_seq or offset != self.next_offset:
            raise ProtocolError(
                f"index out of order: chunk {seq}@{offset}, expected "
                f"{self.next_seq}@{self.next_offset}",
                "malformed",
            )
        expected = chunk_length(seq, self._max_chunk)
        if not 0 < length <= expected:
            raise ProtocolError(f"index chunk {seq} has bad length {length}", "malformed")
        if self._short_seen:
            # only the last chunk may be short: a guest that indexes tiny chunks
            # must not make the host hold millions of chunk records
            raise ProtocolError(f"index chunk {seq} follows a short chunk", "malformed")
        self._short_seen = length < expected
        if not is_hex(digest, self._algorithm.hex_len):
            raise ProtocolError(f"index chunk {seq} has a bad hash", "malformed")
        self.next_seq += 1
        self.next_offset += length
        return Chunk(seq, offset, length, digest)

    @property
    def clean(self) -> bool:
        """True when no partial line is pending (the index so far is whole)."""
        return not self._partial
