"""asyncssh's import runs no compiler (``wsync.transports.sshlib``, issue 13).

Its search for liboqs used to run ``gcc``, ``collect2`` and ``ld`` on every ``ssh://``
command of a host without liboqs: about 30 ms and six programs.  These tests import
the ssh transport in a fresh interpreter with ``gcc`` and ``ld`` shimmed to log, and
check what the lookup still finds.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wsync.transports import sshlib

_LOG = """#!/bin/sh
echo "$0 $*" >> {log}
exit 1
"""


def test_importing_the_ssh_transport_runs_no_compiler(tmp_path: Path) -> None:
    """With logging ``gcc`` and ``ld`` first on PATH and a loader cache that has neither
    liboqs nor nettle, importing the transport runs neither tool; asyncssh still has its
    ML-KEM key exchange, and ``find_library`` is CPython's own again afterwards."""
    shims, log = tmp_path / "shims", tmp_path / "runs.log"
    shims.mkdir()
    for tool in ("gcc", "cc", "ld", "collect2"):
        (shims / tool).write_text(_LOG.format(log=log))
        (shims / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    env.pop("LD_LIBRARY_PATH", None)
    probe = (
        "import ctypes.util; find = ctypes.util.find_library\n"
        # a host whose loader cache has neither liboqs nor nettle (this one has nettle)
        "ctypes.util._findSoname_ldconfig = lambda name: None\n"
        "import wsync.transports.ssh\n"
        "import asyncssh.crypto.pq as pq\n"
        "assert ctypes.util.find_library is find\n"
        "print(pq.mlkem_available)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
    assert not log.exists(), log.read_text()
    # the shims do log when called: the same lookup without this module runs them
    plain = "import ctypes.util; ctypes.util.find_library('oqs')"
    subprocess.run([sys.executable, "-c", plain], env=env, timeout=120, check=True)
    assert log.exists() and "gcc" in log.read_text()


def test_other_names_go_to_cpythons_lookup() -> None:
    seen: list[str] = []

    def find(name: str) -> str | None:
        seen.append(name)
        return f"lib{name}.so.9"

    lookup = sshlib._cached_lookup(find)
    assert lookup is not None
    assert lookup("z") == "libz.so.9" and seen == ["z"]
    # asyncssh's names: the loader's cache, never ``find``
    cache = ctypes.util._findSoname_ldconfig  # type: ignore[attr-defined]
    assert lookup("nettle") == cache("nettle") and lookup("oqs") == cache("oqs")
    assert seen == ["z"]


@pytest.mark.skipif(
    not (shutil.which("ld") and shutil.which("objdump")), reason="needs binutils (ld, objdump)"
)
def test_a_liboqs_on_ld_library_path_is_still_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library found only through ``LD_LIBRARY_PATH`` (not in the loader's cache) is
    found as before: here a copy of libz named ``liboqs.so``, by its soname."""
    libz = ctypes.util.find_library("z")
    assert libz is not None
    dirs = [Path(p) for p in ("/lib", "/usr/lib", "/lib64", "/usr/lib64")]
    found = [d / libz for d in dirs + [s for d in dirs for s in d.glob("*-linux-gnu*")]]
    source = next((f for f in found if f.exists()), None)
    if source is None:
        pytest.skip(f"{libz} is in none of {[str(d) for d in dirs]}")
    shutil.copy(source, tmp_path / "liboqs.so")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    lookup = sshlib._cached_lookup(ctypes.util.find_library)
    assert lookup is not None
    assert lookup("oqs") == libz
