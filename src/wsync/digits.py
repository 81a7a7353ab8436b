"""Decimal numbers in text that another program wrote: ASCII digits only.

``str.isdigit`` also takes ``²`` or ``٣``, which ``int`` then refuses (or reads as another
number): a check that passes followed by a conversion that raises is a crash where a clear
error was due.  ``bytes.isdigit`` is ASCII only already; this is for ``str``.
"""

from __future__ import annotations


def ascii_digits(text: str) -> bool:
    """``text`` is one or more of ``0``-``9`` and nothing else."""
    return text.isascii() and text.isdigit()


def figure(text: str | bytes) -> int | None:
    """``text`` as a count or size of at most 19 digits (what a signed 64-bit field holds),
    else None.  ``int`` of a guest's 5,000 digits raises ``ValueError`` (Python's limit on
    conversions), and ``float`` of 400 ``OverflowError``: neither is the clear error due."""
    digits = text.isdigit() if isinstance(text, bytes) else ascii_digits(text)
    return int(text) if digits and len(text) <= 19 else None
