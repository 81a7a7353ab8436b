"""Decimal numbers in text that another program wrote: ASCII digits only.

``str.isdigit`` also takes ``²`` or ``٣``, which ``int`` then refuses (or reads as another
number): a check that passes followed by a conversion that raises is a crash where a clear
error was due.  ``bytes.isdigit`` is ASCII only already; this is for ``str``.
"""

from __future__ import annotations


def ascii_digits(text: str) -> bool:
    """``text`` is one or more of ``0``-``9`` and nothing else."""
    return text.isascii() and text.isdigit()
