"""Backend emulators: real servers on loopback that misbehave like the real backends.

They are part of the package (not only of the tests) because ``wsync demo``
and ``wsync doctor`` run against them: a user can watch the field reports'
faults happen and watch wsync come back exact anyway.  Every fault is
switchable and parameterised, and drawn from a seeded RNG so a failing
schedule can be replayed.
"""

from __future__ import annotations

from wsync.emulators.sprites import EmulatorThread, SpritesEmulator
from wsync.emulators.sprites_faults import SpritesFaults

__all__ = ["EmulatorThread", "SpritesEmulator", "SpritesFaults"]
