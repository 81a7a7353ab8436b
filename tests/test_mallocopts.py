"""glibc's malloc settings for the CLI's process (:mod:`wsync.mallocopts`): after
:func:`~wsync.mallocopts.tune`, a freed 4 MiB buffer no longer moves the mmap threshold
(the next one is mapped again, so freeing it returns it to the kernel), and eight busy
threads share two heaps.  Each check runs in a fresh interpreter (the settings are the
process's), once without ``tune()``, where glibc's defaults must show: else the check
could not fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's"
)

_PROBE = textwrap.dedent(
    """
    import ctypes, os, sys, tempfile, threading

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        print("no-glibc")
        raise SystemExit(0)
    if sys.argv[1] == "tuned":
        from wsync import mallocopts
        assert mallocopts.tune()

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    big = 4 << 20
    first = libc.malloc(big)
    libc.free(first)
    again = libc.malloc(big)
    mapped = libc.mallinfo2().hblkhd >= big
    libc.free(again)

    # eight threads, each allocating while the others are alive: a heap each by default
    go = threading.Barrier(9)
    def work():
        go.wait()
        blocks = [libc.malloc(64) for _ in range(1000)]
        go.wait()
        for b in blocks:
            libc.free(b)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    go.wait()
    go.wait()
    for t in threads:
        t.join()
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "info.xml").encode()
        f = libc.fopen(path, b"w")
        libc.malloc_info(0, f)
        libc.fclose(f)
        heaps = open(path, "rb").read().count(b"<heap nr=")
    print(f"mapped={mapped} heaps={heaps}")
    """
)


def probe(mode: str) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-glibc":
        pytest.skip("not glibc (no mallinfo2)")
    return dict(item.split("=") for item in out.stdout.split())


def test_glibc_defaults_show_what_tune_changes() -> None:
    """The control: without tune(), the second 4 MiB buffer comes from a heap (the
    threshold rose when the first was freed) and the threads got heaps of their own."""
    found = probe("default")
    assert found["mapped"] == "False"
    assert int(found["heaps"]) > 2


def test_tuned_buffers_stay_mapped_and_threads_share_two_heaps() -> None:
    found = probe("tuned")
    assert found["mapped"] == "True"
    assert int(found["heaps"]) <= 2
