"""Hash algorithms the guest may have, and their host-side twins.

The guest hashes with whatever tool it has; the host must compute the very same
digest.  Preference order is speed: xxh128 (``xxhsum -H2``) first, then BLAKE2b
(``b2sum``, coreutils), then SHA-256 (``sha256sum``, also in busybox).  The
probe runs each candidate on a fixed input and the host compares the output to
the digest it computes itself, so a guest tool that exists but prints something
else (an old ``xxhsum`` without ``-H2``, a wrapper) is never chosen.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Protocol

import xxhash


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Algorithm:
    #: the id passed to guest scripts (a fixed token, never user input)
    name: str
    #: the guest tool that must exist
    tool: str
    new: Callable[[], Hasher]
    hex_len: int

    def digest(self, data: bytes | bytearray | memoryview) -> str:
        h = self.new()
        h.update(data)
        return h.hexdigest()


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("xxh128", "xxhsum", xxhash.xxh128, 32),
        Algorithm("b2", "b2sum", hashlib.blake2b, 128),
        Algorithm("sha256", "sha256sum", hashlib.sha256, 64),
    )
}

#: the fixed input of the probe's self-test
PROBE_INPUT = b"wsync-probe"


def _md5() -> Hasher:
    return hashlib.md5(usedforsecurity=False)


#: the probe's envelope hash.  Before the probe we do not know which strong hash
#: the guest has, but coreutils and busybox both ship ``md5sum``, and it catches
#: the bit flips and splices a lossy channel makes (it is not offered for chunks).
#: A guest without it answers ``-`` and the probe is checked by length only.
PROBE_ALGORITHM = Algorithm("md5", "md5sum", _md5, 32)


def is_hex(value: str, length: int) -> bool:
    return len(value) == length and all(c in "0123456789abcdef" for c in value)
