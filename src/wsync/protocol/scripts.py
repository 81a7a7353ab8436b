"""The guest scripts, rendered as argv lists.

Every script is constant POSIX ``sh`` text (tested under dash and busybox
``sh``); every variable part is passed as a positional argument, never spliced
into the text.  Transports that need one command string join the argv with
:func:`shlex.join`, so each value is quoted exactly once, by ``shlex.quote``.

The staging root is private to the pulling user (issue 7, item 1): by default
``/tmp/wsync-UID``, computed in the guest; the probe creates it (umask 077)
and refuses it, before anything else is written, when it overlaps the
workspace (a usage error, exit 2) or when it is a symlink, not owned by the
user, writable by group or others, or lies beneath a directory that someone
other than root or the user could change (OpenSSH StrictModes; a staging
failure, exit 5, naming the path and its owner).  Every later call uses the
physical path the probe answered.  Only a producer that hashes to what the
host expects is ever run, and a pid read back from staging is killed only when
it is a process of this user running the producer (checked in ``/proc``).

Layout in the guest (``ROOT`` is the staging root, outside the workspace)::

    ROOT/.producer-HASH.sh  the producer script, checked against its hash before every run

    ROOT/SNAPSHOT/launch/   admission token: whoever creates it starts the producer;
                            ``launch/size`` holds the workspace size and the free
                            space measured at admission (KiB), for a full disk's message
    ROOT/SNAPSHOT/pid.launch  the pid of the latest launch (the producer, once detached)
    ROOT/SNAPSHOT/lock.N/pid  generation N's claim: the one producer that writes the
                            snapshot (see the producer); a launched snapshot with no
                            live producer and no result is launched again (generation N+1)
    ROOT/SNAPSHOT/pid       the pid of the producer holding the latest claim
    ROOT/SNAPSHOT/data      the compressed tar stream, append-only
    ROOT/SNAPSHOT/index     one line per chunk, appended only after the chunk
                            is in ``data`` and hashed: ``C seq offset length hash``
    ROOT/SNAPSHOT/isize     the index's size in bytes, rewritten after each line: a
                            hint that lets a status long poll look without a fork
    ROOT/SNAPSHOT/done      written atomically (tmp + mv) when the stream is
                            complete: chunks, length, whole-stream hash, and
                            the exit status of tar and of the compressor
    ROOT/SNAPSHOT/failed    written instead of ``done`` on any failed step;
                            ``disk-full KB: ...`` when the disk was full then

Every write in the producer is checked; a failed write ends in ``failed``,
never in ``done`` (field report 3, finding 1).  Every script's answer is an
envelope (see :mod:`wsync.protocol.envelope`).  With ``gate=1`` a script first
waits for one line on stdin, which the transport sends only once it is
attached, so nothing is printed before the host is listening.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import re
import shlex
import urllib.parse
from collections.abc import Sequence
from typing import TypedDict

from wsync.errors import UsageError
from wsync.protocol.callsh import SCRIPTS, compact
from wsync.protocol.hashing import ALGORITHMS, PROBE_INPUT
from wsync.protocol.producer import _PRODUCER

#: snapshot ids are ours, but they become guest paths: keep them boring
SNAPSHOT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")

#: reads and chunks are aligned to this; ``dd`` works in these blocks
BLOCK = 64 * 1024

PRODUCER = compact(_PRODUCER)
#: the producer gzipped (no name, no time: the same bytes every run) in base64
PRODUCER_GZ64 = base64.b64encode(gzip.compress(PRODUCER.encode(), compresslevel=9, mtime=0)).decode(
    "ascii"
)
#: the producer's file name in the staging root (not snapshot-shaped: never GC'd)
PRODUCER_NAME = ".producer-" + hashlib.sha256(PRODUCER.encode()).hexdigest()[:16] + ".sh"


#: the snapshot files the host reads back: the stream, its index, and the lists
#: of files that never settled or that vanished after being read
READABLE = ("data", "index", "unstable", "gone")


class Wire(TypedDict):
    """What every call after the probe passes: how to talk, and where staging is."""

    gate: bool
    nonce: str
    algorithm: str
    b64: bool
    staging_root: str


def check_snapshot_id(snapshot: str) -> str:
    if not SNAPSHOT_ID.fullmatch(snapshot):
        raise UsageError(f"bad snapshot id {snapshot!r} (want [a-z0-9-], 1-64 chars)")
    return snapshot


#: an argument with no value (see :func:`render`)
NONE = "-"


def render(
    name: str, *, gate: bool, nonce: str, algorithm: str, b64: bool, args: tuple[str, ...]
) -> list[str]:
    """argv for one guest call: ``sh -c SCRIPT wsync GATE NONCE HASH ENC ARGS...``.

    No argument may be empty: Daytona's daemons before PR #3918 split the command text
    into words and drop empty ones, which would shift every later argument (a default
    staging root would have become the next argument's text); an argument that may have
    no value passes ``-`` (:data:`NONE`), which no script takes for a value.
    """
    if "" in args:
        raise ValueError(f"an empty argument to the {name} script (pass {NONE!r})")
    return [
        "sh",
        "-c",
        SCRIPTS[name],
        "wsync",
        "1" if gate else "0",
        nonce,
        algorithm,
        "b64" if b64 else "raw",
        *args,
    ]


def check_staging_root(root: str) -> str:
    """The configured staging root, normalized; ``""`` (the default) means
    ``/tmp/wsync-UID``, resolved in the guest by the probe.

    Only absolute (or ``~/``) paths without ``.``/``..`` components: the probe
    locates the root physically before creating anything, by walking up to
    the nearest directory that exists.
    """
    if root == "":
        return root
    if any(ord(c) < 32 or ord(c) == 127 for c in root):
        raise UsageError(f"--staging-dir holds a control character: {root!r}")
    if not (root.startswith("/") or root == "~" or root.startswith("~/")):
        raise UsageError(f"--staging-dir must be an absolute path (or start with ~/): {root!r}")
    if {".", ".."} & set(root.split("/")):
        raise UsageError(f"--staging-dir must not contain '.' or '..' components: {root!r}")
    return re.sub("/+", "/", root).rstrip("/") or "/"


#: the digest a working ``xxhsum -H2`` gives the probe's input: where the guest's gives
#: it, the probe does not try the other hash tools
_PROBE_XXH128 = ALGORITHMS["xxh128"].digest(PROBE_INPUT)


def probe(
    *, gate: bool, nonce: str, b64: bool, workspace: str, staging_root: str, free: bool = False
) -> list[str]:
    """Answers the guest's tools and, once the workspace is a directory, the
    staging root's physical path (created and checked; see
    :data:`wsync.protocol.callsh.STAGE`) and, with ``free``, its free space (two programs
    a pull need not run: the admission measures the room it checks)."""
    root = check_staging_root(staging_root) or NONE  # (never a configured root: not absolute)
    args = (workspace, root, _PROBE_XXH128, "1" if free else "0")
    return render("probe", gate=gate, nonce=nonce, algorithm="md5", b64=b64, args=args)


#: the longest argv, as one shell command line (:func:`exec_length`), that goes as an exec
#: where argv may be long (``Capabilities.long_argv``): under Dropbear's 9,000-byte
#: command limit (MAX_CMD_LEN), the strictest server of those transports
EXEC_CARRY_MAX = 8 * 1024


def exec_length(argv: Sequence[str]) -> int:
    """The bytes of ``argv`` as one shell command line (how ssh sends an exec)."""
    return len(shlex.join(argv))


#: the longest argv, as a URL's query encodes it (:func:`url_length`), that goes to an exec
#: endpoint taking argv in its URL (Sprites, Kubernetes): servers and proxies refuse request
#: lines over about 8 KiB, and the path and the other parameters come along
URL_ARGV_MAX = 7600


def url_length(argv: Sequence[str]) -> int:
    """The bytes of ``argv`` in a URL's query, one parameter an argument (``urlencode``
    quotes every byte but letters, digits and ``_.-~``), named as the longer of the two
    backends' names (Kubernetes' ``command``; Sprites says ``cmd``)."""
    return sum(len(urllib.parse.quote(arg, safe="")) + len("&command=") for arg in argv)


#: listed sizes from here up (1 EiB) are not passed to the admission: none fits anyway,
#: and ``du`` decides
NEED_KB_MAX = 2**50


def admit(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    workspace: str,
    chunk_size: int,
    compressor: str,
    ttl_minutes: int,
    run: str,
    producer_hash: str,
    mode: str = "tar",
    prune: tuple[str, ...] = (),
    need_kb: int | None = None,
    status_looks: int = -1,
    inline: int = 0,
    clean: bool = False,
    tools: str = NONE,
    collect: bool = True,
) -> list[str]:
    """``mode`` is the producer's: ``tar`` (the whole workspace), ``manifest`` (one record
    per entry, ``prune`` naming find ``-name`` globs left out in the guest) or ``select``
    (the entries of the list uploaded with :func:`upload`).

    ``need_kb`` is the workspace's size as this run's listing gave it: a ``tar`` run's
    check for room in the staging admits on it without walking the tree with ``du``
    (which still decides before a refusal).  It goes only to a ``tar`` run and only
    below :data:`NEED_KB_MAX`: a guest's manifest may claim any sizes, and the guest's
    shell arithmetic must never see a number it cannot hold (dash stops at one).

    ``run`` identifies this wsync run: a retried admission it made itself
    answers ``admitted`` again; only another run's snapshot is ``reconciled``.

    The guest runs the installed producer only when it hashes to
    ``producer_hash`` (with the negotiated algorithm); otherwise it answers
    ``producer-missing`` and the host installs it afresh.

    With ``status_looks`` ≥ 0 the answer goes on with the snapshot's status, as
    :func:`status` gives it from index offset 0 with that many looks and ``inline``: the
    first status call, saved.  The status runs from the producer's ``--status`` mode
    (whose hash the admission has just checked), so the script is only a few hundred
    bytes longer than the plain one; the caller sends it as an exec only while it fits
    (:meth:`wsync.engine.guest.GuestSession._exec_fits`: a command line under
    :data:`EXEC_CARRY_MAX`, or a URL under :data:`URL_ARGV_MAX`).  With ``clean`` too, a
    status that carries the finished stream whole removes the snapshot's staging and
    says ``cleaned 1`` (the stream is the host's then: no cleanup call is needed for it).

    ``tools`` are what the probe saw (``g`` for GNU tar, ``c`` and ``p`` for find's
    ``-cnewer`` and ``-printf``, ``s`` for tar's ``--sort=name``): programs the producer
    would otherwise run each time.
    Without ``collect`` the stale snapshots are left alone: the pull's first admission
    has just collected them.
    """
    check_snapshot_id(snapshot)
    if tools != NONE and not set(tools) <= set("gcps"):
        raise ValueError(f"bad tools {tools!r}")
    if not -1 <= status_looks <= 600 or not 0 <= inline <= STATUS_INLINE_MAX:
        raise ValueError("bad status arguments")
    if chunk_size <= 0 or chunk_size % BLOCK:
        raise UsageError(f"chunk size must be a positive multiple of {BLOCK}")
    args = (
        staging_root,
        snapshot,
        workspace,
        str(chunk_size),
        compressor,
        str(max(1, ttl_minutes)) if collect else NONE,
        PRODUCER_NAME,
        run,
        producer_hash,
        check_mode(mode),
        tools,
        str(need_kb)
        if mode == "tar" and need_kb is not None and 0 <= need_kb < NEED_KB_MAX
        else NONE,
        *((str(status_looks), str(inline), "1" if clean else "0") if status_looks >= 0 else ()),
        *prune,
    )
    name = "admit_status" if status_looks >= 0 else "admit"
    return render(name, gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


#: producer text per install call: argv travels in a URL on some backends
INSTALL_PART = 1536
#: the same where an exec's argv may be long (``Capabilities.long_argv``): each call's
#: command line stays under :data:`EXEC_CARRY_MAX` (Dropbear's limit), and
#: the 12 KB producer goes in 3 calls instead of 9 (a round trip each on the HTTP
#: backends, on the first pull of every fresh sandbox)
INSTALL_PART_LONG = 5120
#: parts of :data:`PRODUCER_GZ64` where argv goes in a URL (base64 stays nearly itself
#: there, where the script's text triples): 3 calls instead of 9
INSTALL_PART_GZ64 = 2944


def install_producer(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    part: int,
    run: str,
    part_size: int = INSTALL_PART,
    encoding: str = "raw",
) -> list[str]:
    """Write part ``part`` of the producer script into the staging root.

    ``encoding`` ``gz64`` sends :data:`PRODUCER_GZ64` (for a guest with ``gzip`` and
    ``base64``), which the last call decodes.

    The producer travels on its own, in parts of ``part_size`` characters
    (:data:`INSTALL_PART`, or :data:`INSTALL_PART_LONG` where argv may be long), so that
    no argv grows past what the exec endpoint accepts (URL-based ones refuse request lines
    over about 8 KiB).  Each part is its own file, so a retried call is idempotent; the
    call with the last part joins them (if a retry of it has not already) and answers the
    script's hash.  The name carries
    the hash: a changed producer never runs under an old name.
    """
    count = install_parts(part_size, encoding)
    text = _install_body(encoding)[part * part_size : (part + 1) * part_size]
    args = (staging_root, PRODUCER_NAME, str(part), str(count), text, check_run_id(run), encoding)
    return render("install", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


def check_run_id(run: str) -> str:
    """Run ids become parts of guest file names: hex only."""
    if not re.fullmatch(r"[0-9a-f]{1,32}", run):
        raise ValueError(f"bad run id {run!r}")
    return run


def install_parts(part_size: int = INSTALL_PART, encoding: str = "raw") -> int:
    return -(-len(_install_body(encoding)) // part_size)


def _install_body(encoding: str) -> str:
    """What an install in ``encoding`` sends: the producer (``raw``) or
    :data:`PRODUCER_GZ64` (``gz64``); the guest's install script knows no other."""
    if encoding == "raw":
        return PRODUCER
    if encoding == "gz64":
        return PRODUCER_GZ64
    raise ValueError(f"bad install encoding {encoding!r}")


def snapshot_dir(staging_root: str, snapshot: str) -> str:
    return f"{staging_root.rstrip('/') or '/'}/{check_snapshot_id(snapshot)}"


#: one look of the status script's long poll, seconds
STATUS_LOOK = 0.05
#: the long poll's first looks are shorter: this many, of this many seconds each
FAST_LOOKS, FAST_LOOK = 20, 0.005


def status_looks(wait: float) -> int:
    """The looks of a long poll that waits about ``wait`` seconds at most."""
    if wait <= FAST_LOOKS * FAST_LOOK:
        return round(wait / FAST_LOOK)
    return FAST_LOOKS + round((wait - FAST_LOOKS * FAST_LOOK) / STATUS_LOOK)


def looks_seconds(looks: int) -> float:
    """The longest a long poll of ``looks`` looks sleeps (its deadline allowance)."""
    fast = min(looks, FAST_LOOKS)
    return fast * FAST_LOOK + (looks - fast) * STATUS_LOOK


#: most index bytes one status answer carries
STATUS_INDEX_MAX = 65536


#: the largest finished stream a status answer carries whole (in base64, 4/3 of it):
#: the data of a small workspace's runs, a manifest of some hundreds of entries
STATUS_INLINE_MAX = 48 * 1024


def status(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    index_from: int = -1,
    looks: int = 0,
    inline: int = 0,
) -> list[str]:
    """The snapshot's state.  With ``index_from`` ≥ 0 the answer carries the index from
    that offset (up to :data:`STATUS_INDEX_MAX` bytes); with ``looks`` it first waits, up
    to that many looks (:func:`looks_seconds`), for the index to grow past ``index_from``.
    With ``inline`` (bytes, at most :data:`STATUS_INLINE_MAX`; the guest needs
    ``base64``) a finished stream no longer than that comes along whole."""
    d = snapshot_dir(staging_root, snapshot)
    if index_from < -1 or not 0 <= looks <= 600 or not 0 <= inline <= STATUS_INLINE_MAX:
        raise ValueError("bad status arguments")
    return render(
        "status",
        gate=gate,
        nonce=nonce,
        algorithm=algorithm,
        b64=b64,
        args=(d, str(index_from), str(looks), str(inline)),
    )


def read(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    file: str,
    offset: int,
    length: int,
) -> list[str]:
    if file not in READABLE:
        raise ValueError(file)
    path = f"{snapshot_dir(staging_root, snapshot)}/{file}"
    args = (path, str(offset), str(length))
    return render("read", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


def cleanup(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshots: Sequence[str],
) -> list[str]:
    """Remove the staging of each of ``snapshots`` (a pull's manifest and content runs go
    in one call), stopping a producer still at work in it."""
    if not snapshots:
        raise ValueError("cleanup needs a snapshot")
    for snapshot in snapshots:
        check_snapshot_id(snapshot)
    args = (staging_root, PRODUCER_NAME, *snapshots)
    return render("cleanup", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


MODES = ("tar", "manifest", "select")
#: list text (base64) per upload call where the list travels in argv
UPLOAD_PART = 4096


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"bad producer mode {mode!r}")
    return mode


def upload(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    how: str,
    part: int = 0,
    parts: int = 1,
    text: str = "",
    digest: str,
) -> list[str]:
    """Stage the NUL-separated list of a ``select`` run as ``SNAPSHOT/list``.

    ``how="stdin"``: the list follows the gate line on stdin (base64 on text channels).
    ``how="argv"``: part ``part`` of ``parts`` of its base64 ``text`` (no stdin: Cloudflare,
    Daytona); the call with the last part joins and decodes them.  Either way the guest
    moves the list into place only when it hashes to ``digest``.
    """
    if how not in ("stdin", "argv"):
        raise ValueError(how)
    args = (
        staging_root,
        check_snapshot_id(snapshot),
        how,
        str(part),
        str(parts),
        text or NONE,  # ("-" is not base64: an empty part, or no part on stdin)
        digest,
    )
    return render("upload", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)
