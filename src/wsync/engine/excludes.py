"""``--exclude`` patterns: the meaning rsync and ``.gitignore`` share, matched with pathspec.

Why pathspec: its gitignore translation is well kept and tested (character classes, ``**``,
escapes, negation), and the meaning users expect is the one rsync and git agree on:

- a pattern without ``/`` matches a name at any depth (``*.pyc``, ``node_modules``);
- a leading ``/`` anchors the pattern at the workspace root (``/build``);
- a trailing ``/`` matches directories only (``cache/``);
- ``*`` and ``?`` match within one name, ``[...]`` is a class (``[!...]`` negated), ``**`` as a
  whole component matches any number of directories (``a/**/b``, ``logs/**``);
- an excluded directory excludes everything under it (neither tool looks inside).

Where the two tools differ we follow rsync, because that is what the equivalence test checks
and what a user replacing ``rsync -a --exclude`` expects:

- a pattern with a ``/`` inside but not at the start (``src/gen``) matches at any depth, as
  rsync "matches it against the end of the path" (git would anchor it); we prepend ``**/``;
- names are matched as bytes, so ``?`` is one byte and a non-UTF-8 name is matched like rsync
  does (paths and patterns go to pathspec as latin-1 text: one character per byte).

Refused with exit 2 (one line naming the pattern): empty patterns, NUL bytes, patterns that
can never match (an unclosed ``[``, a lone ``/``), a ``**`` that is not a whole component and
rsync's ``***`` (their meaning differs between the tools), POSIX bracket classes such as
``[[:digit:]]`` (pathspec does not know them), and a trailing lone ``\\``.
Negation (``!pattern``, re-include) is gitignore's; rsync has no such rule, so it is outside
what the equivalence test covers.  Files given with ``--exclude-from`` hold one pattern per
line; blank lines and lines starting with ``#`` or ``;`` are skipped, as rsync does.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from wsync.errors import UsageError

if TYPE_CHECKING:
    from pathspec import GitIgnoreSpec
    from pathspec.patterns.gitignore.spec import GitIgnoreSpecPattern

#: directory verdicts remembered while a manifest streams past (cleared when this many)
_DIR_CACHE = 65536
#: a "[" that opens a class: not escaped, i.e. after an even number of backslashes
_OPEN = r"(?<!\\)(?:\\\\)*\["
#: a POSIX class, equivalence class or collating symbol inside a bracket expression: find's
#: fnmatch and rsync know them, pathspec reads "[[:digit:]]" as the set "[[:digt]" then "]"
_BRACKET_CLASS = re.compile(_OPEN + r"[!^]?\]?[^\]]*\[([:=.]).*?\1\]")
#: a backslash inside a bracket expression: rsync's fnmatch takes it as an escape
#: ("[\\a]" is "a"), the regex pathspec makes as a member
_ESCAPE_IN_CLASS = re.compile(_OPEN + r"[!^]?\]?[^\]]*\\")
#: rsync's wildcards: only a pattern with one of them takes a backslash as an escape
_WILDCARDS = re.compile(r"[*?\[]")


class Excludes:
    """A compiled list of exclude patterns; immutable once built."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.patterns = patterns
        lines = [_to_gitignore(p) for p in patterns]
        self._spec: GitIgnoreSpec | None = _compile(lines) if lines else None
        self._dirs: dict[bytes, bool] = {}

    # -- building -------------------------------------------------------------------------

    @classmethod
    def none(cls) -> Excludes:
        return cls(())

    @classmethod
    def from_options(cls, patterns: Sequence[str], files: Sequence[Path]) -> Excludes:
        """Patterns from ``--exclude`` (in order) then from each ``--exclude-from`` file
        (``-``: standard input).

        UsageError (exit 2, one line) for a file that cannot be read or a malformed pattern.
        """
        collected: list[str] = []
        for pattern in patterns:
            collected.append(check_pattern(pattern, f"--exclude {pattern!r}"))
        for file in files:
            try:
                # "-": standard input, as rsync reads it (a second "-" finds it read)
                data = _read_stdin() if str(file) == "-" else Path(file).read_bytes()
            except OSError as exc:
                raise UsageError(
                    f"--exclude-from {file}: cannot read it: {exc.strerror or exc}"
                ) from None
            for number, raw in enumerate(data.splitlines(), 1):
                line = os.fsdecode(raw.rstrip(b"\r"))
                if not line or line[0] in "#;":
                    continue
                collected.append(check_pattern(line, f"--exclude-from {file}, line {number}"))
        return cls(tuple(collected))

    # -- matching -------------------------------------------------------------------------

    def __bool__(self) -> bool:
        return self._spec is not None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Excludes) and other.patterns == self.patterns

    def __hash__(self) -> int:
        return hash(self.patterns)

    def __repr__(self) -> str:
        return f"Excludes({list(self.patterns)!r})"

    def excluded(self, path: bytes, is_dir: bool) -> bool:
        """True when ``path`` (workspace-relative, ``/``-separated) or a parent is excluded.

        The root (``b"."``) is never excluded.  Parent verdicts are cached, so a manifest that
        lists a directory's entries together costs one match per entry.
        """
        if self._spec is None or path in (b".", b""):
            return False
        parent, _, _ = path.rpartition(b"/")
        if parent and self._dir_excluded(parent):
            return True
        return self._match(path, is_dir)

    def _dir_excluded(self, path: bytes) -> bool:
        known = self._dirs.get(path)
        if known is not None:
            return known
        parent, _, _ = path.rpartition(b"/")
        verdict = (bool(parent) and self._dir_excluded(parent)) or self._match(path, True)
        if len(self._dirs) >= _DIR_CACHE:
            self._dirs.clear()
        self._dirs[path] = verdict
        return verdict

    def _match(self, path: bytes, is_dir: bool) -> bool:
        assert self._spec is not None
        text = path.decode("latin-1") + ("/" if is_dir else "")
        return self._spec.match_file(text)

    # -- the guest's share ----------------------------------------------------------------

    def guest_prune(self) -> list[str]:
        """``find -name`` globs the guest may prune: each excludes exactly those names.

        Only patterns that are a single name (no ``/`` anywhere, so no anchor and no
        directory-only rule) with no ``**`` qualify, and none at all when any pattern is a
        negation (a re-include below a pruned name would be lost).  A name glob means the
        same to ``find -name`` (fnmatch without FNM_PATHNAME or FNM_PERIOD) as to rsync:
        ``*``, ``?``, ``[...]``/``[!...]`` and backslash escapes.  ``[^...]`` and non-ASCII
        patterns are left to the host (busybox's fnmatch and multibyte locales differ); the
        guest must run find under ``LC_ALL=C`` so ``?`` is one byte.  The host still filters
        every manifest entry, so pruning less is only slower, never different.
        """
        if any(p.startswith("!") for p in self.patterns):
            return []
        globs: list[str] = []
        for pattern in self.patterns:
            if "/" in pattern or "**" in pattern or "[^" in pattern or not pattern.isascii():
                continue
            if not pattern.isprintable() or pattern.startswith("-"):
                continue
            if "\\" in pattern and not _WILDCARDS.search(pattern):
                continue  # a literal backslash to rsync, an escape to find -name
            globs.append(pattern)
        return globs


def check_pattern(pattern: str, where: str) -> str:
    """``pattern`` if pathspec and rsync agree on its meaning, else UsageError at ``where``."""
    why = _malformed(pattern)
    if why is None:
        try:
            spec = _compile([_to_gitignore(pattern)])
        except (ValueError, re.error) as exc:  # GitIgnorePatternError is a ValueError
            why = str(exc).splitlines()[0]  # (re.error: a range backwards, "[b-a]")
        else:
            if not spec.patterns or spec.patterns[0].regex is None:
                why = "it can never match (an unclosed '[' or only '/')"
    if why is not None:
        raise UsageError(f"{where}: malformed exclude pattern: {why}")
    return pattern


def _compile(lines: list[str]) -> GitIgnoreSpec:
    # pathspec is loaded only when there are patterns (10 ms of every run otherwise)
    from pathspec import GitIgnoreSpec

    # a literal '[' in a class ("[[]") compiles to a regex Python warns may mean a nested
    # set some day; today it is what rsync means, and the warning is noise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return GitIgnoreSpec.from_lines(lines, pattern_factory=_pattern)


def _pattern(line: str) -> GitIgnoreSpecPattern:
    """pathspec's pattern, with negated classes kept off ``/`` (in rsync and git a class
    never matches the slash between names, but the regex ``[^a]`` does, so ``a[!a]`` would
    match the directory ``x/a/`` by the trailing slash that marks it as a directory), and
    newlines in names matched as any other byte."""
    from pathspec.patterns.gitignore.spec import GitIgnoreSpecPattern

    pattern = GitIgnoreSpecPattern(line)
    regex = pattern.regex
    if regex is None:
        return pattern
    text = regex.pattern
    if "[" in text:
        text = _guard_classes(text)
    # a name may hold a newline, which rsync matches like any byte: "." must match it
    # (else "**" stops at it) and the end must be the end ("$" also matches before a
    # final newline, so "notes.txt" excluded a file named "notes.txt\n")
    text = text.replace("|$)", r"|\Z)")
    if text.endswith("$") and not _trailing_escape(text[:-1]):
        text = text[:-1] + r"\Z"
    pattern.regex = re.compile(text, regex.flags | re.DOTALL)
    return pattern


def _malformed(pattern: str) -> str | None:
    if not pattern or pattern == "!":
        return "empty pattern"
    if "\0" in pattern or "\n" in pattern:
        return "a NUL or newline in the pattern"
    body = pattern[1:] if pattern.startswith("!") else pattern
    if body.rstrip("/") in ("", "/"):
        return "only '/' (it would exclude the whole workspace)"
    if body.endswith("//"):
        return "more than one trailing '/' (rsync strips one, and then matches nothing)"
    if body.startswith("+ "):
        return "rsync's include rules ('+ PATTERN') are not supported"
    if _trailing_escape(body):
        return "a trailing lone backslash"
    if _ESCAPE_IN_CLASS.search(body):
        return "a backslash inside '[...]' is not supported (rsync takes it as an escape)"
    if _BRACKET_CLASS.search(body):
        return (
            "POSIX bracket classes ('[[:digit:]]', '[[=a=]]', '[[.a.]]') are not supported: "
            "the host's matcher and the guest's find read them differently (write '[0-9]')"
        )
    for part in body.strip("/").split("/"):
        if "***" in part:
            return "rsync's '***' is not supported (write 'dir/' to exclude a directory)"
        if "**" in part and part != "**":
            return "'**' must be a whole path component (a/**/b, **/x, logs/**)"
    return None


def _trailing_escape(text: str) -> bool:
    count = len(text) - len(text.rstrip("\\"))
    return count % 2 == 1


def _to_gitignore(pattern: str) -> str:
    """The gitignore line with rsync's meaning, in latin-1 text (one character per byte)."""
    negate = pattern.startswith("!")
    body = pattern[1:] if negate else pattern
    # rsync's "- " prefix names an exclude rule, which every pattern here is
    body = body.removeprefix("- ")
    if not _WILDCARDS.search(body):
        # without a wildcard rsync takes a backslash as itself ("a\b" is that name)
        body = body.replace("\\", "\\\\")
    dir_only = body.endswith("/")
    inner = body.rstrip("/")
    comps = inner.split("/")  # anchored: comps[0] == ""
    for i in range(1, len(comps)):
        if comps[i] != "**" or (comps[i - 1] == "" and i == len(comps) - 1):
            continue  # only "/**" itself means everything in both tools
        # rsync's "**" between two slashes, or after the last one, matches one name or
        # more ("a/**/b" is not "a/b", "a/**" is not "a"); gitignore's matches zero or more
        comps[i] = "**/*" if i == len(comps) - 1 else "*/**"
    body = "/".join(comps) + ("/" if dir_only else "")
    if "/" in inner and not inner.startswith("/") and not inner.startswith("**/"):
        body = "**/" + body  # rsync: a pattern with an inner '/' matches at any depth
    text = os.fsencode(body).decode("latin-1")
    if text.startswith("#"):
        text = "\\" + text  # a comment to gitignore, a name to rsync
    if text.endswith(" ") and not _trailing_escape(text[:-1]):
        # gitignore drops trailing spaces, rsync keeps them: escape the last one
        text = text[:-1] + "\\ "
    return ("!" if negate else "") + text


def _guard_classes(text: str) -> str:
    """``text`` (a regex pathspec made) with ``(?!/)`` before each class but pathspec's
    own ``[^/]``: a class never matches the ``/`` between names in rsync, neither a
    negated one (``[!a]``) nor a range over it (``[+-0]``, ``[ -~]``).

    A lookahead, not a ``/`` member: inside the class it could join a range (``[!]-a]``);
    only classes that open outside a class (``[[^a]`` is the class of ``[``, ``^`` and
    ``a``); and never ``[^/]``, pathspec's ``*``, which must still match nothing before
    the ``/`` that marks a directory (``cache*/`` excludes ``cache``).  (Found by three
    reviews; the scan is a review's sketch.)"""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            out.append(text[i : i + 2])
            i += 2
            continue
        if c != "[":
            out.append(c)
            i += 1
            continue
        j = i + 1
        if j < n and text[j] == "^":
            j += 1
        if j < n and text[j] == "]":
            j += 1  # a leading "]" is a member
        while j < n and text[j] != "]":
            j += 2 if text[j] == "\\" else 1
        cls = text[i : j + 1]
        if cls != "[^/]":
            out.append("(?!/)")
        out.append(cls)
        i = j + 1
    return "".join(out)


def _read_stdin() -> bytes:
    """Standard input's bytes, for ``--exclude-from -``.  A process started with fd 0
    closed has no ``sys.stdin`` (None), and an in-process caller of ``wsync.cli.main`` may
    have put a text stream there: neither is an internal error."""
    stream = sys.stdin
    if stream is None:
        raise OSError(errno.EBADF, "there is no standard input")
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        return bytes(buffer.read())
    return os.fsencode(stream.read())
