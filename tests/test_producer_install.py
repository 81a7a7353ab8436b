"""The producer's install in parts (:meth:`GuestSession.install_producer`): every call
fits the exec it goes by, whatever the staging root's length, and a compressed install
that fails never mixes with the plain one after it (found by a review)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from helpers import assert_exact, options, run_pull
from wsync.engine.guest import GuestSession
from wsync.errors import TransportError
from wsync.protocol import scripts
from wsync.protocol.hashing import ALGORITHMS
from wsync.transports.local import LocalTransport
from wsync.transports.sshcommand import wrapped

#: Dropbear refuses ssh command lines longer than this (MAX_CMD_LEN)
DROPBEAR_MAX_CMD_LEN = 9000


@pytest.mark.parametrize("long_argv", [True, False], ids=["long-argv", "url"])
@pytest.mark.parametrize("encoding", ["raw", "gz64"])
def test_install_parts_shrink_until_every_call_fits(long_argv: bool, encoding: str) -> None:
    """A staging root of 700 bytes: the parts shrink until each call fits the command line
    (where argv may be long) or the URL (Sprites, Kubernetes)."""
    root = "/" + "/".join(["r" * 99] * 7)
    session = GuestSession.__new__(GuestSession)
    session.long_argv = long_argv
    session.gate, session.b64, session.staging_root = True, True, root
    session.algorithm = ALGORITHMS["xxh128"]
    session.run_id = "f" * 16
    wire = scripts.Wire(gate=True, nonce="0" * 16, algorithm="xxh128", b64=True, staging_root=root)

    def fits(size: int) -> bool:
        parts = range(scripts.install_parts(size, encoding))
        argvs = [
            scripts.install_producer(
                **wire, part=p, run="f" * 16, part_size=size, encoding=encoding
            )
            for p in parts
        ]
        if long_argv:
            return all(scripts.exec_length(argv) <= scripts.EXEC_CARRY_MAX for argv in argvs)
        return all(scripts.url_length(argv) <= scripts.URL_ARGV_MAX for argv in argvs)

    start = scripts.INSTALL_PART_LONG if long_argv else scripts.INSTALL_PART_GZ64
    size = session._install_size(encoding, start)
    assert fits(size)
    assert size == start if fits(start) else size < start
    if encoding == "raw":  # the script's text grows under quoting: these did not fit
        assert not fits(start)


class Dropbear(LocalTransport):
    """A transport whose argv may be long, with Dropbear's limit on the command line."""

    capabilities = dataclasses.replace(LocalTransport.capabilities, channel=False)

    async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        if len(wrapped(argv)[1]) > DROPBEAR_MAX_CMD_LEN:
            raise TransportError("exec request refused (command too long)")
        return await super().exec(argv, **kw)


def test_a_pull_with_a_long_staging_root_through_dropbear(tmp_path: Path) -> None:
    """A staging root of 1,600 bytes: every call fits Dropbear's command line (5 KiB
    parts would not), and the pull is exact."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("hello\n")
    root = tmp_path / "st" / "/".join(["d" * 200] * 8)
    assert len(str(root)) > 1500
    opts = options(tmp_path, helpers=False, staging_root=str(root), max_attempts=2)
    run_pull(Dropbear(), ws, tmp_path / "out", opts)
    assert_exact(ws, tmp_path / "out")


def _call(root: Path, env: dict[str, str], part: int, encoding: str) -> bytes:
    size = scripts.INSTALL_PART_LONG
    argv = scripts.install_producer(
        gate=False,
        nonce="0" * 16,
        algorithm="sha256",
        b64=False,
        staging_root=str(root),
        part=part,
        run="ab" * 8,
        part_size=size,
        encoding=encoding,
    )
    return subprocess.run(argv, env=env, capture_output=True, timeout=60).stdout


def test_a_late_part_of_a_failed_compressed_install_never_mixes_into_the_plain_one(
    tmp_path: Path,
) -> None:
    """The compressed install fails (a gzip that cannot decode) and the plain one follows
    under the same run id; a late call of the compressed install (a stalled attempt whose
    process outlived its retry) lands in the middle of it.  Their parts have names of
    their own: the plain install joins only its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gzip").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "gzip").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    root = tmp_path / "staging"
    for part in range(scripts.install_parts(scripts.INSTALL_PART_LONG, "gz64")):
        out = _call(root, env, part, "gz64")
    assert b" err " in out  # the host falls back to the plain install
    _call(root, env, 0, "raw")
    _call(root, env, 1, "raw")
    _call(root, env, 1, "gz64")  # the late call
    _call(root, env, 2, "raw")
    assert (root / scripts.PRODUCER_NAME).read_text() == scripts.PRODUCER


def test_an_install_encoding_the_guest_does_not_know_is_refused() -> None:
    """The install script joins plain parts for any encoding but ``gz64``: a misspelt one
    would send the compressed text to be installed undecoded (and fail on its hash)."""
    wire = scripts.Wire(gate=True, nonce="0" * 16, algorithm="b2", b64=True, staging_root="/s")
    with pytest.raises(ValueError, match="install encoding"):
        scripts.install_producer(**wire, part=0, run="f" * 16, encoding="gzip64")
    with pytest.raises(ValueError, match="install encoding"):
        scripts.install_parts(scripts.INSTALL_PART, "gzip64")
