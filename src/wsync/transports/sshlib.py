"""asyncssh, imported without running the C compiler.

On import asyncssh looks for liboqs, for its post-quantum key exchanges, with
``ctypes.util.find_library("oqs")`` and then ``("liboqs")``.  Where the dynamic
loader's cache (``ldconfig -p``) has no such library, CPython's lookup goes on to run
``gcc`` (and its ``collect2`` and ``ld``) and then ``ld`` to search their paths: six
programs and about 30 ms of every ``ssh://`` command on a host without liboqs, most
hosts (measured 2026-12-03: a one-file pull took 0.66 s in all; issue 13).

While asyncssh imports, those two names are looked up in the loader's cache and, where
``LD_LIBRARY_PATH`` is set, by ``ld`` in its directories (the one place outside the
cache that a library loaded by name can come from); only gcc's own search paths are
left out, where a library installed without ``ldconfig`` would be found.  asyncssh
then offers ML-KEM from ``cryptography`` as before and leaves sntrup761 out, as it
would without liboqs.  Every other name, and every later lookup, is CPython's.
"""

from __future__ import annotations

import ctypes.util
import os
from collections.abc import Callable

_COMPILER_FREE = frozenset({"oqs", "liboqs"})


def _cached_lookup(
    find: Callable[[str], str | None],
) -> Callable[[str], str | None] | None:
    """``find`` with :data:`_COMPILER_FREE` looked up without gcc; None where this
    Python's ``ctypes.util`` has not the pieces (another platform or version)."""
    ldconfig = getattr(ctypes.util, "_findSoname_ldconfig", None)
    ld = getattr(ctypes.util, "_findLib_ld", None)
    soname = getattr(ctypes.util, "_get_soname", None)
    if ldconfig is None or ld is None or soname is None:
        return None

    def lookup(name: str) -> str | None:
        if name not in _COMPILER_FREE:
            return find(name)
        found: str | None = ldconfig(name)
        if found is None and os.environ.get("LD_LIBRARY_PATH"):
            found = soname(ld(name))
        return found

    return lookup


_find = ctypes.util.find_library
_lookup = _cached_lookup(_find)
if _lookup is not None:
    ctypes.util.find_library = _lookup  # type: ignore[assignment]  # same signature
try:
    # after the lookup is in place: the point of this module
    import asyncssh
finally:
    ctypes.util.find_library = _find

__all__ = ["asyncssh"]
