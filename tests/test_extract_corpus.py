"""Crafted archives after other projects' tar test corpora, each held to one invariant.

Go's ``archive/tar`` testdata, CPython's ``test_tarfile`` archives and libarchive's test
archives collect what real writers have produced over the years: v7, ustar, old-GNU, pax and
star headers, GNU long names and links, base-256 numbers, pax records of every length,
hardlink chains, sparse members, odd names.  Each case here is written by hand
(:mod:`tar_craft`) after those descriptions.  The invariant, per archive: the extraction is
*exactly* what GNU tar extracts from the same bytes (GNU tar is what the guest runs, so it is
the reference), or it is refused with wsync's own error for the stated reason; never another
exception, never a write outside the root.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extract_helpers import extract, make_root, outside, restore_writable, snapshot
from tar_craft import (
    END,
    FIELDS,
    T0,
    USTAR,
    V7,
    base256,
    ext,
    file,
    header,
    longlink,
    longname,
    pax,
    payload,
    record,
    seal,
)
from wsync.engine.api import ExtractLimits
from wsync.errors import HostileArchive, WsyncError

LIMITS = ExtractLimits(min_free_bytes=0)
EXACT = "exact"


def gnu_extracts(data: bytes, dest: Path) -> subprocess.CompletedProcess[bytes]:
    """GNU tar extracting ``data`` into ``dest``, as root (modes and owners kept)."""
    dest.mkdir()
    return subprocess.run(["tar", "-xf", "-", "-C", str(dest)], input=data, capture_output=True)


def same_tree(root: Path, data: bytes, *, gnu_may_fail: bool = False) -> None:
    """``root`` holds exactly what GNU tar extracts from ``data`` (beside it, unwatched).

    The root's own mtime counts only when the archive has a root member: otherwise it is
    the time the entries were made, in both trees.  With ``gnu_may_fail``, an archive that
    GNU tar extracts with errors (exit 2) must still give the same tree but for mtimes: GNU
    tar sets -1 where wsync clamps a date beyond ``time_t`` (docs/fidelity.md), and it
    complains about owner fields that wsync does not read.
    """
    reference = root.parent / "gnu"
    done = gnu_extracts(data, reference)
    if not gnu_may_fail:
        assert done.returncode == 0, done.stderr
    ours, theirs = snapshot(root), snapshot(reference)
    listed = subprocess.run(["tar", "-tf", "-"], input=data, capture_output=True).stdout
    if not {b".", b"./"} & set(listed.splitlines()):
        ours[b"."] = ours[b"."][:2]
        theirs[b"."] = theirs[b"."][:2]
    if done.returncode != 0:
        ours = {k: v[:2] + v[3:] for k, v in ours.items()}
        theirs = {k: v[:2] + v[3:] for k, v in theirs.items()}
    assert ours == theirs


def check(tmp_path: Path, data: bytes, expect: str) -> None:
    """The invariant: ``EXACT`` as GNU tar extracts it, or refused with ``expect`` said."""
    root = make_root(tmp_path)
    before = outside(root)
    try:
        if expect == EXACT:
            extract(data, root, LIMITS)
            same_tree(root, data)
        else:
            with pytest.raises(HostileArchive, match=expect):
                extract(data, root, LIMITS)
        assert outside(root) == before
    finally:
        restore_writable(tmp_path)


# -- the corpus --------------------------------------------------------------------------------

D = b"5"
SYM = b"2"
LNK = b"1"


def _sparse_old_gnu() -> bytes:
    """An old-GNU sparse member ('S'): one 512-byte hole-free map entry, as Go's sparse-formats."""
    fields = {"prefix": bytes(41) + b"%011o\0" % 0 + b"%011o\0" % 4 + bytes(155 - 65)}
    return header(b"sparse", b"S", 4, fields=fields) + payload(b"data")


def _star() -> bytes:
    """A star header: ustar magic, a short prefix, then atime and ctime, ``tar\\0`` at 508."""
    star = b"dir".ljust(131, b"\0") + b"%011o " % 1_600_000_001 + b"%011o " % 1_600_000_002
    block = bytearray(header(b"f", size=2, magic=USTAR, prefix=star[:155]))
    block[500:512] = bytes(8) + b"tar\0"
    return header(b"dir", D, magic=USTAR) + seal(block) + payload(b"st") + END


CORPUS: dict[str, tuple[Callable[[], bytes], str]] = {
    # formats
    "v7": (
        lambda: (
            header(b"d/", b"\0", mode=0o755, magic=V7)
            + header(b"d/f", b"\0", 3, magic=V7)
            + payload(b"abc")
            + header(b"d/h", LNK, link=b"d/f", magic=V7)
            + header(b"d/s", SYM, link=b"f", magic=V7)
            + END
        ),
        EXACT,
    ),
    "ustar-prefix": (
        lambda: (
            header(b"a" * 99, D, mode=0o755, magic=USTAR)
            + header(b"b" * 100, b"0", 2, magic=USTAR, prefix=b"a" * 99)
            + payload(b"pf")
            + END
        ),
        EXACT,
    ),
    "old-gnu-atime-in-prefix": (
        lambda: file(b"f", b"x", fields={"prefix": b"%011o\0" % 1_600_000_123}) + END,
        EXACT,
    ),
    "star": (_star, EXACT),  # the name is dir/f, as GNU tar reads it
    "gnu-long-name-and-link": (
        lambda: (
            longname(b"n" * 250)
            + file(b"n" * 99, b"long")
            + longname(b"s" * 200)
            + longlink(b"/t" * 300)
            + header(b"s" * 99, SYM, link=b"t" * 99)
            + longname(b"h" * 150)
            + longlink(b"n" * 250)
            + header(b"h" * 99, LNK, link=b"n" * 99)
            + END
        ),
        EXACT,
    ),
    "pax-path-and-linkpath": (
        lambda: (
            pax(record(b"path", b"p" * 250), record(b"mtime", b"1600000000.123456789"))
            + file(b"ignored", b"pax")
            + pax(record(b"path", b"l"), record(b"linkpath", b"../" * 200 + b"etc"))
            + header(b"l-ignored", SYM, link=b"x")
            + pax(record(b"linkpath", b"p" * 250))
            + header(b"h", LNK, link=b"ignored")
            + END
        ),
        EXACT,
    ),
    "pax-overrides-gnu-long-name": (
        lambda: longname(b"gnu-name") + pax(record(b"path", b"pax-name")) + file(b"x", b"1") + END,
        EXACT,
    ),
    "pax-global-mtime": (
        lambda: (
            ext(b"g", record(b"mtime", b"1500000000.5"))
            + file(b"a", b"1")
            + pax(record(b"mtime", b"1400000000"))
            + file(b"b", b"2")
            + END
        ),
        EXACT,
    ),
    "pax-record-lengths-across-digit-counts": (
        lambda: (
            pax(*(record(b"comment", b"c" * n) for n in (0, 1, 85, 86, 87, 986, 987, 988)))
            + file(b"f", b"x")
            + END
        ),
        EXACT,
    ),
    "pax-xattrs-and-unknown-keywords-ignored": (
        lambda: (
            pax(
                record(b"SCHILY.xattr.user.test", b"value\0with nul"),
                record(b"LIBARCHIVE.xattr.user.x", b"dmFsdWU="),
                record(b"uname", b"nobody"),
                record(b"vendor.unknown", b"\xff\xfe"),
            )
            + file(b"f", b"x")
            + END
        ),
        EXACT,
    ),
    "pax-size-overrides-header": (
        lambda: pax(record(b"size", b"5")) + header(b"f", size=0) + payload(b"12345") + END,
        EXACT,
    ),
    "pax-binary-path": (
        lambda: (
            pax(record(b"hdrcharset", b"BINARY"), record(b"path", b"caf\xe9\nnl"))
            + file(b"x", b"bin")
            + END
        ),
        EXACT,
    ),
    "base256-size-and-mtimes": (
        lambda: (
            header(b"f", size=3, fields={"size": base256(3)})
            + payload(b"b25")
            + header(b"old", mtime=-315_619_200)
            + header(b"new", mtime=9_246_182_400)
            + header(b"mode", fields={"mode": base256(0o640, 8)})
            + END
        ),
        EXACT,
    ),
    "numeric-fields-space-terminated-or-short": (
        lambda: (
            header(b"a", fields={"mode": b"644 ", "mtime": b"13727342000 ", "size": b"1 "})
            + payload(b"x")
            + header(b"b", fields={"mode": b"  0644\0", "size": b"000000000002"})
            + payload(b"yy")
            + END
        ),
        EXACT,
    ),
    "numeric-fields-after-a-leading-nul": (
        lambda: (
            header(b"a", fields={"mode": b"\0000640", "size": b"\x000000000003"})
            + payload(b"nul")
            + header(b"b", fields={"mtime": b"\0" + base256(T0, 11)})
            + END
        ),
        EXACT,
    ),
    "full-width-name-and-linkname": (
        lambda: file(b"n" * 100, b"full") + header(b"s" * 100, SYM, link=b"t" * 100) + END,
        EXACT,
    ),
    "dir-with-trailing-slashes-and-dot": (
        lambda: (
            header(b"./", D, mode=0o750)
            + header(b"./d//", D, mode=0o700)
            + file(b"./d/./f", b"x")
            + END
        ),
        EXACT,
    ),
    "pax-global-path-alone": (
        lambda: ext(b"g", record(b"path", b"gp")) + file(b"x", b"1") + END,
        EXACT,
    ),
    "pax-linkpath-on-a-file-ignored": (
        lambda: pax(record(b"linkpath", b"zz")) + file(b"x", b"1") + END,
        EXACT,
    ),
    "pax-mtime-forms": (
        lambda: (
            pax(record(b"mtime", b"1600000000."))
            + file(b"a", b"1")
            + pax(record(b"mtime", b"1600000000.1234567899999"))
            + file(b"b", b"2")
            + pax(record(b"mtime", b"-1.0000000009"))  # rounds toward the past
            + file(b"c", b"3")
            + END
        ),
        EXACT,
    ),
    "gnu-long-name-then-pax": (
        lambda: longname(b"gnu") + pax(record(b"path", b"pax")) + file(b"x", b"1") + END,
        EXACT,
    ),
    "gnu-long-name-dir-and-long-link-hardlink": (
        lambda: (
            longname(b"dd/")
            + header(b"x", D)
            + file(b"f", b"1")
            + longlink(b"f")
            + header(b"h", LNK, link=b"ignored")
            + END
        ),
        EXACT,
    ),
    "gnu-long-name-without-nul-or-with-two": (
        lambda: (
            ext(b"L", b"abc", b"././@LongLink")
            + file(b"x", b"1")
            + ext(b"L", b"def\0ghi", b"././@LongLink")
            + file(b"y", b"2")
            + END
        ),
        EXACT,
    ),
    "regular-type-with-trailing-slash-is-a-dir": (
        lambda: (
            header(b"x" * 99, D)
            + longname(b"x" * 99 + b"/f")  # the header's name field ends in "/": not a dir
            + file(b"x" * 99 + b"/", b"f")
            + header(b"d/", b"0", mode=0o750, magic=USTAR)
            + pax(record(b"path", b"e/"))
            + header(b"x", b"0", mode=0o705)
            + END
        ),
        EXACT,
    ),
    "pax-empty-path-is-an-empty-name": (
        lambda: pax(record(b"path", b"")) + file(b"x", b"1") + END,
        "empty name",
    ),
    "pax-empty-mtime-is-malformed": (
        lambda: ext(b"g", record(b"mtime", b"1")) + pax(record(b"mtime", b"")) + file(b"b") + END,
        "malformed pax mtime",
    ),
    "pax-mtime-with-sign-or-space": (
        lambda: pax(record(b"mtime", b"+1600000000")) + file(b"x", b"1") + END,
        "malformed pax mtime",
    ),
    "hardlink-chain": (
        lambda: (
            file(b"f", b"shared")
            + header(b"h1", LNK, link=b"f")
            + header(b"h2", LNK, link=b"h1")
            + header(b"h3", LNK, link=b"./h2")
            + END
        ),
        EXACT,
    ),
    "empty-files": (
        lambda: b"".join(file(b"e%d" % i) for i in range(20)) + END,
        EXACT,
    ),
    "contiguous-type-is-a-file": (lambda: header(b"c", b"7", 2) + payload(b"ct") + END, EXACT),
    "odd-names": (
        lambda: (
            file(b"new\nline", b"1")
            + file(b"caf\xe9", b"2")
            + file(b"-dash", b"3")
            + file(b" lead space", b"4")
            + file(b"\x01ctrl\x7f", b"5")
            + longname(b"c" * 255)
            + file(b"c", b"255-byte component")
            + END
        ),
        EXACT,
    ),
    "trailing-zeros-to-10k": (lambda: file(b"f", b"x") + bytes(10240 - 1024), EXACT),
    # refused
    "trailing-garbage": (lambda: file(b"f", b"x") + END + b"garbage", "after the end-of-archive"),
    "lone-extended-header": (lambda: pax(record(b"path", b"x")) + END, "extended header alone"),
    "two-gnu-long-names": (
        lambda: longname(b"a") + longname(b"b") + file(b"x") + END,
        "repeated GNU long name",
    ),
    "two-pax-headers": (
        lambda: pax(record(b"path", b"a")) + pax(record(b"path", b"b")) + file(b"x") + END,
        "repeated pax header",
    ),
    "pax-record-length-too-long": (
        lambda: ext(b"x", b"30 path=abc\n") + file(b"x") + END,
        "malformed pax record",
    ),
    "pax-record-length-too-short": (
        lambda: ext(b"x", b"5 path=abc\n") + file(b"x") + END,
        "malformed pax record",
    ),
    "pax-record-no-newline": (
        lambda: ext(b"x", b"12 path=abcd") + file(b"x") + END,
        "malformed pax record",
    ),
    "pax-record-leading-space": (
        lambda: ext(b"x", b" 9 a=bcd\n") + file(b"x") + END,
        "malformed pax record",
    ),
    "pax-bad-mtime": (
        lambda: pax(record(b"mtime", b"1e9")) + file(b"x") + END,
        "malformed pax mtime",
    ),
    "pax-negative-size": (
        lambda: pax(record(b"size", b"-1")) + file(b"x") + END,
        "malformed pax size",
    ),
    "pax-nul-in-path": (
        lambda: pax(record(b"path", b"a\0b")) + file(b"x") + END,
        "NUL byte",
    ),
    "pax-sparse": (
        lambda: (
            pax(record(b"GNU.sparse.major", b"1"), record(b"GNU.sparse.minor", b"0"))
            + file(b"s", b"x")
            + END
        ),
        "sparse files are not supported",
    ),
    "old-gnu-sparse": (lambda: _sparse_old_gnu() + END, "GNU sparse file"),
    "base256-negative-size": (
        lambda: header(b"f", fields={"size": base256(-1)}) + END,
        "negative size",
    ),
    "payload-on-a-directory": (
        lambda: header(b"d", D, 3) + payload(b"abc") + END,
        "unexpected payload",
    ),
    "payload-on-a-hardlink": (
        lambda: file(b"f", b"x") + header(b"h", LNK, 1, link=b"f") + payload(b"y") + END,
        "unexpected payload",
    ),
    "bad-checksum": (
        lambda: header(b"f", fields={"chksum": b"0000000\0"}) + END,
        "bad tar header",
    ),
    "non-octal-size": (
        lambda: header(b"f", fields={"size": b"12x"}) + END,
        "bad tar header",
    ),
    "gnu-volume-header": (lambda: header(b"vol", b"V") + END, "unsupported member type"),
    "gnu-multivolume": (lambda: header(b"mv", b"M") + END, "unsupported member type"),
    "gnu-dumpdir": (lambda: header(b"dd", b"D") + END, "unsupported member type"),
    "gnu-long-name-empty": (lambda: longname(b"") + file(b"x", b"1") + END, "empty name"),
    "symlink-named-like-a-dir": (
        lambda: header(b"s/", SYM, link=b"t", magic=USTAR) + END,
        "not a file name",
    ),
    "hardlink-to-itself": (lambda: header(b"h", LNK, link=b"h") + END, "not an earlier"),
    "empty-archive-no-marker": (lambda: b"", "no end-of-archive marker"),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_corpus_archive_extracts_as_gnu_tar_or_is_refused(tmp_path: Path, case: str) -> None:
    make, expect = CORPUS[case]
    check(tmp_path, make(), expect)


# -- a deep tree, cuts and damage in every header field ------------------------------------------


def test_thousand_deep_tree_extracts_exactly(tmp_path: Path) -> None:
    """Issue 7 item 7's tree: extraction itself must work (cleanup is the pull's business)."""
    src = tmp_path / "src"
    deep = os.fsencode(src)
    os.mkdir(deep)
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(1000):  # by fd: the path outgrows PATH_MAX
            os.mkdir(b"d", dir_fd=fd)
            nxt = os.open(b"d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if i % 250 == 249:
                f = os.open(b"f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(f, b"%d" % i)
                os.close(f)
    finally:
        os.close(fd)
    for fmt in ((), ("--format=posix",)):
        data = subprocess.run(
            ["tar", *fmt, "-cf", "-", "-C", str(src), "."], check=True, capture_output=True
        ).stdout
        case = tmp_path / ("t" + "".join(fmt))
        case.mkdir()
        check(case, data, EXACT)
    subprocess.run(["rm", "-rf", str(tmp_path)], check=True)  # pytest's rmtree recurses


SMALL = (
    pax(record(b"path", b"p" * 120), record(b"mtime", b"1600000000.5"))
    + file(b"ignored", b"pax data")
    + longname(b"g" * 120)
    + longlink(b"t" * 120)
    + header(b"g", SYM, link=b"t")
    + header(b"d", D, mode=0o755, magic=USTAR)
    + file(b"d/f", b"x" * 700, magic=USTAR)
    + END
)
MARKER = len(SMALL) - len(END)


def cuts() -> list[int]:
    """Every header field of every block of ``SMALL`` cut at its start, middle and last byte."""
    out = set()
    for block in range(0, MARKER, 512):
        for off, length in FIELDS.values():
            out |= {block + off, block + off + length // 2, block + off + length - 1}
    return sorted(out | {MARKER})


def test_every_cut_before_the_end_marker_is_refused_as_truncated(tmp_path: Path) -> None:
    for cut in cuts():
        root = tmp_path / str(cut) / "stage" / "root"
        root.mkdir(parents=True)
        with pytest.raises(HostileArchive, match="truncated"):
            extract(SMALL[:cut], root, LIMITS)
    for cut in (MARKER + 512, MARKER + 700, MARKER + 1024):  # the marker itself arrived
        case = tmp_path / f"after{cut}"
        case.mkdir()
        check(case, SMALL[:cut], EXACT)


@pytest.mark.parametrize("value", [b"", b"\xff" * 12, b" " * 12, b"9" * 12, b"-1", b"\x80"])
def test_damage_in_every_header_field_is_exact_or_refused(tmp_path: Path, value: bytes) -> None:
    """Each field of each header of ``SMALL`` overwritten (checksum resealed)."""
    blocks = [
        i for i in range(0, len(SMALL) - len(END), 512) if SMALL[i + 257 : i + 262] == b"ustar"
    ]
    refused = 0
    for at in blocks:
        for field, (off, length) in FIELDS.items():
            if field == "chksum":
                continue
            data = bytearray(SMALL)
            data[at + off : at + off + length] = value[:length].ljust(length, b"\0")
            data[at : at + 512] = seal(data[at : at + 512])
            case = tmp_path / f"{at}-{field}"
            case.mkdir()
            root = make_root(case)
            try:
                extract(bytes(data), root, LIMITS)
            except WsyncError:
                refused += 1  # fine, as long as nothing was written outside (below)
            else:
                same_tree(root, bytes(data))
            assert sorted(os.listdir(case)) == ["outside", "sentinel", "stage"]
            restore_writable(case)
    assert refused  # the damage reached checks, not only ignored fields


def test_sparse_files_arrive_dense_and_sparse_members_are_refused(tmp_path: Path) -> None:
    """docs/fidelity.md: the producer's plain ``tar -c`` stores holes as zeros (so they are
    written dense); ``tar -S`` sparse members (old-GNU 'S' or pax GNU.sparse) are refused."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as f:
        f.truncate(8 * 1024 * 1024)
        f.write(b"head")
    assert os.stat(src / "sparse").st_blocks * 512 < 1024 * 1024  # really sparse here
    dense = tmp_path / "dense"
    dense.mkdir()
    plain = subprocess.run(
        ["tar", "-cf", "-", "-C", str(src), "."], check=True, capture_output=True
    ).stdout
    check(dense, plain, EXACT)
    assert os.stat(dense / "stage/root/sparse").st_blocks * 512 >= 8 * 1024 * 1024
    for fmt, reason in ((("--format=gnu",), "GNU sparse file"), (("--format=posix",), "sparse")):
        case = tmp_path / fmt[0][2:].replace("=", "-")
        case.mkdir()
        data = subprocess.run(
            ["tar", "-S", *fmt, "-cf", "-", "-C", str(src), "."], check=True, capture_output=True
        ).stdout
        check(case, data, reason)


# -- the corpus, mutated ---------------------------------------------------------------------------

SEEDS = sorted(case for case, (_make, expect) in CORPUS.items() if expect == EXACT)


@st.composite
def mutated_corpus(draw: st.DrawFn) -> bytes:
    """A corpus archive with a few bytes changed (a header's checksum resealed) or cut."""
    data = bytearray(CORPUS[draw(st.sampled_from(SEEDS))][0]())
    for _ in range(draw(st.integers(1, 3))):
        headers = [i for i in range(0, len(data) - 511, 512) if data[i + 257 : i + 262] == b"ustar"]
        op = draw(st.sampled_from(["header"] * 4 + ["any", "cut"]))
        if op == "header" and headers:
            at = draw(st.sampled_from(headers))
            off = draw(st.integers(0, 511))
            data[at + off] = draw(st.sampled_from([0, 0x20, 0x2F, 0x2E, 0x30, 0x37, 0x80, 0xFF]))
            data[at : at + 512] = seal(data[at : at + 512])
        elif op == "any" and data:  # pax records and long names live in data blocks
            data[draw(st.integers(0, len(data) - 1))] = draw(
                st.sampled_from([0, 0x0A, 0x20, 0x2F, 0x2E, 0x30, 0x3D, 0x39])
            )
        else:
            del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_corpus())
def test_mutated_corpus_is_exact_or_refused(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = make_root(Path(tmp))
        before = outside(root)
        try:
            extract(data, root, LIMITS)
        except WsyncError:  # any other exception fails the test
            pass
        else:
            same_tree(root, data, gnu_may_fail=True)
        finally:
            assert outside(root) == before
            restore_writable(Path(tmp))
