"""``--dry-run`` lines in the shape of ``rsync -i``: 11 flag characters, then the path.

Why rsync's shape: users compare wsync with ``rsync -a``, and scripts that read ``rsync -i``
output read these.  ``YXcstpoguax``: Y is ``>`` for a file to fetch, ``c`` for a directory
or symlink to create, ``h`` for a file fetched as another name of a fetched inode, ``.`` for
metadata only; X is the kind (``f d L D S``); then ``+++++++++`` for a new entry, or ``c``
(content or link target differs), ``s`` (size), ``t`` (mtime), ``p`` (permissions).  Entries
DEST lost or that were changed on the host since the last pull are fetched again, shown as
new (lost) or with ``c`` (changed on the host).  Deletions read ``*deleting``.

Paths are printed safely whatever their bytes (a guest's names reach a terminal here): every
byte that is not part of printable UTF-8, and the backslash itself, is written ``\\#ooo``
(octal), as rsync does, so the line is one line and tells names apart.
"""

from __future__ import annotations

from collections.abc import Sequence

#: (kind, mode, size, mtime, ctime, ino, target, digest) of a manifest record
Record = Sequence[object]

_KIND = {"f": "f", "d": "d", "l": "L", "p": "S", "s": "S", "c": "D", "b": "D"}


def escape(name: bytes) -> str:
    """``name`` for a terminal: printable UTF-8 as is, every other byte as ``\\#ooo``.

    Most names are printable as they are: one ``isprintable`` over the whole name (a byte
    that is not UTF-8 decodes to a lone surrogate, which is not printable) answers for
    them without the loop (0.22 µs a name of the stdlib tree, where the loop took 3.7 µs).
    Every entry a pull removes is named this way, in case it cannot be removed."""
    text = name.decode("utf-8", "surrogateescape")
    if text.isprintable() and "\\" not in text:
        return text
    return _escape_each(text)


def _escape_each(text: str) -> str:
    """:func:`escape`'s rule, one character of the decoded name at a time."""
    out: list[str] = []
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\#{code - 0xDC00:03o}")
        elif ch == "\\" or not ch.isprintable():
            out.extend(f"\\#{byte:03o}" for byte in ch.encode("utf-8", "surrogatepass"))
        else:
            out.append(ch)
    return "".join(out)


def strict_text(text: str) -> str:
    """``text`` as strict UTF-8 can carry it: unchanged where it can, else :func:`escape`'d.

    Why: a name that is not UTF-8 (a DEST given as raw bytes on the command line) is a
    ``str`` with lone surrogates here; ``json.dumps`` writes them as ``\\udcff``, which
    Python reads back but strict JSON decoders refuse, so one odd name would make a whole
    ``--json`` result unreadable to a script.  (A valid name is left as it is, so one that
    holds ``\\#377`` itself reads like an escaped byte: the name was the caller's own.)"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return escape(text.encode("utf-8", "surrogateescape" if _escaped(text) else "replace"))
    return text


def _escaped(text: str) -> bool:
    """Every lone surrogate of ``text`` is one that ``surrogateescape`` made (a byte)."""
    return all(not 0xD800 <= ord(ch) <= 0xDFFF or 0xDC80 <= ord(ch) <= 0xDCFF for ch in text)


def changed_flags(act: str, new: Record, old: Record) -> str:
    """The 11 flag characters for an entry the diff did not keep."""
    kind = str(new[0])
    x = _KIND.get(kind, "S")
    if kind == "f":
        y = "h" if act == "linked" else ">"
    elif kind == "d":
        y = "c" if act == "new" else "."
    else:
        y = "c"
    if act in ("new", "missing") or old[0] is None or old[0] != kind:
        return y + x + "+" * 9
    if act == "changed":
        s = "s" if kind != "d" and new[2] != old[2] else "."
        t = "t" if new[3] != old[3] else "."
        p = "p" if new[1] != old[1] else "."
        # c: the content changed with nothing else to show it (a rewrite with the size and
        # mtime put back: only the guest's ctime, inode or digest moved), or a new link target
        quiet = kind == "f" and s + t + p == "..." and new[4:8] != old[4:8]
        c = "c" if quiet or (kind == "l" and new[6] != old[6]) else "."
        return y + x + c + s + t + p + "....."
    return y + x + "c" + "." * 8


def itemize_line(code: str, path: bytes, is_dir: bool, target: bytes) -> str:
    shown = "./" if path == b"." else escape(path) + ("/" if is_dir else "")
    if target:
        shown += " -> " + escape(target)
    return f"{code:<11} {shown}"
