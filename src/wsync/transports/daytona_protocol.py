"""The Daytona toolbox wire format, sans-I/O: shared by the client and the emulator.

Daytona's ``POST {toolbox}/{id}/process/execute`` takes ``{"command", "timeout", "cwd"}``
and answers once, when the command is over, with ``{"exitCode": N, "result": "..."}``:
stdout and stderr merged into one buffer, turned into a Go ``string`` and serialised by
``encoding/json`` (every invalid UTF-8 byte becomes U+FFFD, controls and ``<>&`` become
``\\u00XX`` escapes).  A timeout kills the process group and answers HTTP 408 with the
output discarded.  ``GET {toolbox}/{id}/files/download?path=`` serves raw bytes through
Go's ``http.ServeFile`` (so ``Range`` is honoured — an inference from the source, not a
documented promise; the client copes with a server that ignores it).

What lives here, and why it is pure:

* :func:`command_text` — the one shell string sent as ``command``.  The daemon pipes it
  into a shell (zsh, bash or sh); older daemons split it on quotes instead.  Both run it
  the same way.  It carries a per-call *marker* so a command the client abandoned can be
  found and killed: the daemon deliberately keeps running a command whose client went
  away (it uses a background context), until its own timeout.
* :func:`kill_argv` — the guest script that kills the process group carrying a marker.
  The execute call names no process, and the daemon may start the shell after the kill
  ran (a busy daemon; the kill travels on another connection), so the killer first
  makes that call's kill marker directory, which the command obeys when it starts.
* :class:`ExecBody` — reads a response body into bounded memory and decodes it.  A
  complete body is parsed with :func:`json.loads`; a body past the bound is decoded as a
  *prefix* (``exitCode`` comes before ``result`` in Go's field order), so a huge output
  costs at most the bound and is reported ``truncated``.
* :func:`go_json_result` — how the daemon serialises output (for the emulator and tests).
* :func:`parse_content_range` / :func:`range_header` — the file API's byte ranges.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import re
import shlex
from collections.abc import Sequence
from typing import Any

from wsync.errors import ProtocolError
from wsync.transports.base import KILL_MARK, refuse_if_killed, sweep_stale_kill_marks

#: the argv word that marks one exec's process (``wsync-exec-<hex>``)
MARKER_PREFIX = "wsync-exec-"
#: the exec's kill marker in the guest: KILL_MARK + the marker's hex
_KILL_MARK = f'{shlex.quote(KILL_MARK)}"${{1#{shlex.quote(MARKER_PREFIX)}}}"'
#: wraps the argv so the marker sits in a long-lived process of the exec's group; a kill
#: that ran before this shell started (the daemon took the request, the shell came
#: later) left the kill marker: then nothing runs, and the marker goes
_WRAP = refuse_if_killed(_KILL_MARK) + 'shift; "$@"; exit $?'
#: JSON escapes are at most 6 characters for one byte of output (``\u0000``)
_ESCAPE_RATIO = 6
#: room for the object around ``result``
_ENVELOPE_SLACK = 4096

_KILL = (
    f"""m={shlex.quote(MARKER_PREFIX)}"$1"
k={shlex.quote(KILL_MARK)}"$1"
# first the kill marker: a command whose shell starts after the scan below runs nothing
mkdir "$k" 2>/dev/null
hit=
"""
    + r"""# grep reads every cmdline in one process (its own pid is not in the list: the shell
# expanded the glob before starting it); then each candidate is checked word-exactly
if command -v grep >/dev/null 2>&1; then
  set -- $(grep -lF -e "$m" /proc/[0-9]*/cmdline 2>/dev/null)
else
  set -- /proc/[0-9]*/cmdline
fi
set -f
for f in "$@"; do
  d=${f%/cmdline}
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  c=$(tr '\000' ' ' < "$f" 2>/dev/null) || continue
  case " $c " in
    *" $m "*) ;;
    *) continue ;;
  esac
  s=$(cat "$d/stat" 2>/dev/null) || continue
  s=${s##*) }
  set -- $s
  g=$3
  [ -n "$g" ] && [ "$g" -gt 1 ] 2>/dev/null || continue
  if kill -9 "-$g" 2>/dev/null || kill -9 "$p" 2>/dev/null; then hit=1; fi
done
# a marked process existed and is killed: its wrapper is past the marker check
if [ -n "$hit" ]; then rmdir "$k" 2>/dev/null; fi
set +f
"""
    + sweep_stale_kill_marks()
    + "exit 0\n"
)


def command_text(argv: Sequence[str], marker: str) -> str:
    """The ``command`` string for ``argv``: every word quoted, the marker in front.

    ``sh -c 'shift; "$@"; exit $?' sh wsync-exec-<hex> ARGV...`` runs ARGV with its exit
    status, and the ``sh`` stays alive as long as ARGV does, carrying the marker in its
    argv (``; exit $?`` keeps shells from exec-ing the last command away; ``shift``
    drops the marker before ARGV runs).  First it checks for the kill marker
    ``/tmp/wsync-kill-<hex>``: a kill that ran before this shell did left it, and then
    nothing runs (exit 137).
    """
    if not argv:
        raise ValueError("empty argv")
    if not marker.startswith(MARKER_PREFIX) or not marker[len(MARKER_PREFIX) :].isalnum():
        raise ValueError(f"bad marker {marker!r}")
    return shlex.join(["sh", "-c", _WRAP, "sh", marker, *argv])


def kill_argv(marker: str) -> list[str]:
    """A guest command that SIGKILLs the process group of the exec carrying ``marker``.

    The marker travels as a positional argument, without its prefix, so the killer's own
    argv never matches.  Only the group of the marked process is killed: a producer that
    detached with ``setsid`` lives in its own group and survives.  Before it looks, the
    killer makes the kill marker directory, so a command whose shell starts after the
    look runs nothing; once it killed a marked process (whose wrapper is then past its
    check) it removes the directory again.
    """
    token = marker.removeprefix(MARKER_PREFIX)
    if not token.isalnum():
        raise ValueError(f"bad marker {marker!r}")
    return ["sh", "-c", _KILL, "sh", token]


def split_command(command: str) -> list[str]:
    """How daemons before PR #3918 turn ``command`` into argv (``parseCommand``): split
    on spaces outside ``'``/``"`` quotes, no escapes, and empty words dropped.

    :func:`command_text` survives it, except for empty arguments (for the emulator).
    """
    args: list[str] = []
    current: list[str] = []
    quote = ""
    for c in command:
        if c in "'\"":
            if not quote:
                quote = c
            elif quote == c:
                quote = ""
            else:
                current.append(c)
        elif c == " " and not quote:
            if current:
                args.append("".join(current))
                current = []
        else:
            current.append(c)
    if current:
        args.append("".join(current))
    return args


def server_timeout(timeout: float) -> int:
    """The request's ``timeout`` field: whole seconds, at least 1 (0 means *no* timeout)."""
    return max(1, min(2**32 - 1, math.ceil(timeout)))


def request_body(command: str, timeout: float, cwd: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command, "timeout": server_timeout(timeout)}
    if cwd:
        body["cwd"] = cwd
    return body


# -- responses ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ExecOutcome:
    """A decoded ``process/execute`` answer."""

    output: bytes
    #: None when the body carried no exit code (never guessed)
    exit_code: int | None
    truncated: bool
    #: output held U+FFFD: invalid bytes were replaced somewhere on the way
    replaced: bool


def body_bound(max_output: int) -> int:
    """Most body bytes worth reading for ``max_output`` bytes of output."""
    return _ESCAPE_RATIO * max_output + _ENVELOPE_SLACK


def _exit_code(obj: dict[str, Any]) -> int | None:
    for key in ("exitCode", "code"):  # the deprecated API and old daemons say "code"
        value = obj.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _outcome(text: str, exit_code: int | None, max_output: int, cut: bool) -> ExecOutcome:
    data = text.encode("utf-8", "replace")  # "replace": a lone surrogate from a bad server
    truncated = cut or len(data) > max_output
    return ExecOutcome(data[:max_output], exit_code, truncated, "\ufffd" in text)


def decode_complete(body: bytes, max_output: int) -> ExecOutcome:
    """Decode a whole 200 body; anything but ``{... "result": "..."}`` is a ProtocolError."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ProtocolError(f"execute answer is not JSON: {err}", "malformed") from None
    if not isinstance(obj, dict):
        raise ProtocolError("execute answer is not a JSON object", "malformed")
    result = obj.get("result")
    if not isinstance(result, str):
        raise ProtocolError("execute answer has no result string", "malformed")
    return _outcome(result, _exit_code(obj), max_output, cut=False)


_WS = re.compile(rb"[ \t\r\n]*")
_SCALAR = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")


def _string_end(buf: bytes, pos: int) -> int | None:
    """End (exclusive) of the complete JSON string at ``pos``, or None.

    A linear scan for the closing quote (one not escaped by an odd run of backslashes):
    a regex with an alternation keeps state per character and took gigabytes on a
    34 MiB unterminated string.
    """
    if buf[pos : pos + 1] != b'"':
        return None
    start = pos + 1
    while (quote := buf.find(b'"', start)) >= 0:
        back = quote
        while back > pos + 1 and buf[back - 1] == 0x5C:  # a backslash
            back -= 1
        if (quote - back) % 2 == 0:
            return quote + 1
        start = quote + 1
    return None


def _skip_ws(buf: bytes, pos: int) -> int:
    m = _WS.match(buf, pos)
    return m.end() if m is not None else pos


def _utf8_whole(raw: bytes) -> bytes:
    """Drop a UTF-8 sequence cut at the end of ``raw``."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte < 0x80:
            return raw
        if byte >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return raw if back >= need else raw[:-back]
    return raw


def _cut_escape(raw: bytes) -> bytes:
    """Drop an escape cut short at the end of ``raw`` (``\\``, ``\\u``, ``\\u00`` ...).

    Only the last escape can be cut, and it starts within the last 6 bytes.  A backslash
    there starts an escape only if the run of backslashes ending at it is odd.
    """
    k = raw.rfind(b"\\", max(0, len(raw) - 6))
    if k < 0:
        return raw
    j = k
    while j > 0 and raw[j - 1] == 0x5C:
        j -= 1
    if (k - j + 1) % 2 == 0:
        return raw  # an escaped backslash, whole
    escape = raw[k:]
    whole = len(escape) >= 6 if escape[1:2] == b"u" else len(escape) >= 2
    return raw if whole else raw[:k]


def _loads(raw: bytes) -> Any:
    """:func:`json.loads` whose every failure (bad escapes, bad UTF-8) is a ProtocolError."""
    try:
        return json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        raise ProtocolError(f"execute answer is not valid JSON: {err}", "malformed") from None


def _partial_string(raw: bytes) -> str:
    """The text of a JSON string's body cut anywhere (no closing quote)."""
    text = _loads(b'"' + _utf8_whole(_cut_escape(raw)) + b'"')
    assert isinstance(text, str)
    if text and "\ud800" <= text[-1] <= "\udbff":  # half a surrogate pair
        text = text[:-1]
    return text


def decode_prefix(prefix: bytes, max_output: int) -> ExecOutcome:
    """Decode the first bytes of a body that went on past the bound.

    Walks the top-level object key by key (``exitCode`` first, as Go writes it); the
    ``result`` string may be cut anywhere, even inside an escape or a UTF-8 sequence.
    Output is always reported truncated.  A shape it cannot walk is a ProtocolError.
    """
    pos = _skip_ws(prefix, 0)
    if prefix[pos : pos + 1] != b"{":
        raise ProtocolError("execute answer is not a JSON object", "malformed")
    pos += 1
    exit_code: int | None = None
    while True:
        pos = _skip_ws(prefix, pos)
        if prefix[pos : pos + 1] == b",":
            pos = _skip_ws(prefix, pos + 1)
        key_end = _string_end(prefix, pos)
        if key_end is None:
            break
        key = _loads(prefix[pos:key_end])
        pos = _skip_ws(prefix, key_end)
        if prefix[pos : pos + 1] != b":":
            break
        pos = _skip_ws(prefix, pos + 1)
        if key == "result":
            if prefix[pos : pos + 1] != b'"':
                raise ProtocolError("execute answer's result is not a string", "malformed")
            whole = _string_end(prefix, pos)
            if whole is not None:
                text = _loads(prefix[pos:whole])
                return _outcome(text, exit_code, max_output, cut=True)
            return _outcome(_partial_string(prefix[pos + 1 :]), exit_code, max_output, cut=True)
        value_end = _string_end(prefix, pos)
        if value_end is None:
            scalar = _SCALAR.match(prefix, pos)
            if scalar is None:
                break  # a nested value: not part of the daemon's answer
            value_end = scalar.end()
        if key in ("exitCode", "code") and exit_code is None:
            parsed = _loads(prefix[pos:value_end])
            if isinstance(parsed, int) and not isinstance(parsed, bool):
                exit_code = parsed
        pos = value_end
    raise ProtocolError("execute answer cut before its result", "malformed")


class ExecBody:
    """Collects a 200 body up to :func:`body_bound` and decodes it.

    Feed chunks with :meth:`feed`; it returns False once the bound is passed (the caller
    stops reading).  :meth:`outcome` decodes what was kept: the whole body, or a prefix.
    """

    def __init__(self, max_output: int) -> None:
        if max_output < 0:
            raise ValueError("max_output must be >= 0")
        self.max_output = max_output
        self.bound = body_bound(max_output)
        self._buf = bytearray()
        self.overflowed = False

    def feed(self, data: bytes) -> bool:
        room = self.bound - len(self._buf)
        if len(data) > room:
            self._buf += data[: max(room, 0)]
            self.overflowed = True
            return False
        self._buf += data
        return True

    def outcome(self) -> ExecOutcome:
        body = bytes(self._buf)
        if self.overflowed:
            return decode_prefix(body, self.max_output)
        return decode_complete(body, self.max_output)


def parse_error(body: bytes) -> str:
    """A short, printable reason from an error body (JSON ``message`` or text), or ''."""
    text = body[:2048].decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        for key in ("message", "error", "code"):
            if isinstance(obj.get(key), str):
                text = obj[key]
                break
    text = " ".join(text.split())
    return "".join(c if c.isprintable() else "?" for c in text)[:200]


# -- how the daemon writes output (emulator, tests) ----------------------------------


def _go_replace(err: UnicodeError) -> tuple[str, int]:
    """Go's ``string`` → JSON: one U+FFFD per invalid byte (Python's "replace" would
    fold a cut sequence into one)."""
    assert isinstance(err, UnicodeDecodeError)
    return "\ufffd", err.start + 1


codecs.register_error("wsync-go-replace", _go_replace)

_GO_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}
_GO_NEEDS = re.compile('[\\x00-\\x1f"\\\\<>&\u2028\u2029]')


def go_lossy(data: bytes) -> str:
    """Bytes as a Go ``string`` reaches JSON: invalid bytes each become U+FFFD."""
    return data.decode("utf-8", "wsync-go-replace")


def go_json_string(text: str) -> str:
    """``encoding/json``'s encoding of a string (HTML-safe escapes, raw UTF-8 otherwise)."""

    def esc(m: re.Match[str]) -> str:
        c = m.group()
        return _GO_ESCAPES.get(c) or f"\\u{ord(c):04x}"

    return '"' + _GO_NEEDS.sub(esc, text) + '"'


def go_json_result(exit_code: int, output: bytes) -> bytes:
    """The 200 body the daemon writes: ``{"exitCode":N,"result":"..."}``."""
    return f'{{"exitCode":{int(exit_code)},"result":{go_json_string(go_lossy(output))}}}'.encode()


def error_body(status: int, message: str, code: str, path: str, method: str) -> bytes:
    """The daemon's ``ErrorResponse`` JSON (``libs/common-go/pkg/errors/http.go``)."""
    return json.dumps(
        {
            "statusCode": status,
            "message": message,
            "code": code,
            "timestamp": "2026-01-01T00:00:00Z",
            "path": path,
            "method": method,
        },
        separators=(",", ":"),
    ).encode()


# -- file ranges -------------------------------------------------------------------

_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)\Z")


def range_header(offset: int, length: int) -> str:
    if offset < 0 or length <= 0:
        raise ValueError("offset must be >= 0 and length > 0")
    return f"bytes={offset}-{offset + length - 1}"


def parse_content_range(value: str) -> tuple[int, int, int | None]:
    """``bytes a-b/size`` → (a, b, size or None); anything else is a ProtocolError."""
    m = _CONTENT_RANGE.match(value.strip())
    if m is None:
        raise ProtocolError(f"bad Content-Range {value[:80]!r}", "malformed")
    first, last = int(m.group(1)), int(m.group(2))
    size = None if m.group(3) == "*" else int(m.group(3))
    if last < first or (size is not None and last >= size):
        raise ProtocolError(f"bad Content-Range {value[:80]!r}", "malformed")
    return first, last, size
