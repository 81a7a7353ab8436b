"""The guest helper: one exec that runs many guest calls, one at a time.

Theory of operation
-------------------
Every exec costs a channel, a login shell (which may source a slow profile: 100 ms
and more in real sandboxes) and a few processes.  A pull makes 9 calls for one small
file and 25 or more for a big tree, so on transports with a streaming stdin and a
binary-safe stdout (ssh, ``local:``) wsync starts a **helper** instead: a small ``sh``
loop that reads requests on stdin, runs each exactly as an exec would have run it,
and marks where its output ends::

    request:   <n> <nonce> <gate>\\n
               <n bytes: the call's argv as one shell command line, then
                "\\n# end <nonce>\\n">
    response:  <what the call printed: its envelope>
               \\nWSYNC1 DONE <nonce>\\n

Nothing about trust changes.  The response is judged exactly as an exec's output is:
only a complete envelope with the call's fresh nonce, its length and its hash counts.
The ``DONE`` line says where to stop reading and proves nothing; a lost or forged one
costs a deadline or a retry, never a wrong byte.  On any fault the host closes that
helper (the next call starts another), and after helpers failed before answering at
all the host goes back to one exec per call.

Why it is safe to run commands this way:

* **Lockstep.**  The host sends a request only once the last one's ``DONE`` arrived,
  so the helper's ``read`` and ``head -c`` never meet bytes of the next request
  (busybox ``head`` reads ahead through stdio; with nothing ahead it cannot).
* **A cut request never runs.**  Its command text must end in ``# end <nonce>`` with
  the header's nonce; a request cut short (the host died mid-write) fails that check
  and the helper exits instead of running a command with arguments missing.
* **Header fields are checked** (a count, hex, a flag) before use, and the command
  text only ever comes from the host: the guest sees it, it never writes it.
* Each call runs in its own subshell, ``exec``-ing the call's ``sh``: what a script
  does (``exit``, ``set``) cannot touch the loop.  Its stdin is a lone newline (a
  pipe, not a here-document: bash before 5.1 writes those to a file in ``$TMPDIR``,
  which may be full) where the call expects the stdin gate, else ``/dev/null``; its
  stderr goes nowhere, as an exec's stderr is never read for meaning.
* Calls share the helper's process group, so the host uses helpers only where the
  guest has ``setsid`` (probed): the producer must live in a group of its own, apart
  from any helper that a failed call takes down with its group.

This module holds the script and the sans-I/O pieces (the request bytes, the
response splitter); :mod:`wsync.engine.helpers` does the I/O.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from wsync.errors import ProtocolError
from wsync.protocol.envelope import MAGIC, trailer_prefix

#: ``sh -c HELPER wsync-helper``; exits when stdin ends or a request is malformed
HELPER = r"""command -v head >/dev/null 2>&1 || exit 3
while IFS=' ' read -r n k g; do
  case $n in ''|*[!0-9]*) exit 2;; esac
  case $k in ''|*[!0-9a-f]*) exit 2;; esac
  case $g in 0|1) ;; *) exit 2;; esac
  c=$(head -c "$n"; echo .)
  case $c in *"
# end $k
.") ;; *) exit 2;; esac
  c=${c%.}
  if [ "$g" = 1 ]; then
    printf '\n' | (eval "exec $c") 2>/dev/null
  else
    (eval "exec $c") </dev/null 2>/dev/null
  fi
  printf '\nWSYNC1 DONE %s\n' "$k"
done
"""

ARGV = ("sh", "-c", HELPER, "wsync-helper")

_NONCE = re.compile(r"[0-9a-f]{1,64}")


def request(argv: Sequence[str], nonce: str, *, gate: bool) -> bytes:
    """The bytes that ask a helper to run ``argv`` as the call ``nonce``."""
    if not _NONCE.fullmatch(nonce):
        raise ValueError(f"a helper nonce is lowercase hex: {nonce!r}")
    # the bytes an exec would pass (``os.fsencode``): a name that is not UTF-8 reaches the
    # guest as it is, not as an internal error of the host
    body = (shlex.join(argv) + f"\n# end {nonce}\n").encode("utf-8", "surrogateescape")
    return f"{len(body)} {nonce} {int(gate)}\n".encode("ascii") + body


#: how a helper's end-of-answer line starts (the nonce and a newline follow)
DONE = b"\n" + MAGIC + b" DONE "


def done_marker(nonce: str) -> bytes:
    return DONE + nonce.encode("ascii") + b"\n"


class ResponseSplitter:
    """Finds where one call's response ends in a helper's stdout.

    Feed it what the channel delivers with :meth:`receive_data` (any split); once
    :attr:`done`, :attr:`response` is everything before the ``DONE`` line (for the
    envelope parser) and :attr:`leftover` anything after it (there should be nothing:
    the host asks one thing at a time).  More than ``limit`` bytes without the line is
    :class:`~wsync.errors.ProtocolError` ("oversize"), so a guest that floods the
    channel costs bounded memory.

    :attr:`answered` says the call's envelope trailer line has arrived: its ``DONE``
    follows at once, so a caller still waiting for it a moment later has a damaged end
    line and takes what came (:meth:`give_up`) instead of waiting out the deadline.
    """

    def __init__(self, nonce: str, limit: int) -> None:
        self._marker = done_marker(nonce)
        self._trailer = trailer_prefix(nonce)
        self._limit = limit
        self._buf = bytearray()
        self._searched = 0
        self._trailer_at = -1
        #: the call's output; a bytearray, handed on as is (the envelope parser takes it
        #: over with ``receive_buffer``): a 4 MiB answer is never copied here
        self.response = bytearray()
        self.leftover = b""
        self.done = False
        self.answered = False

    def receive_data(self, data: bytes) -> None:
        if self.done:
            self.leftover += data
            return
        self._buf += data
        at = self._buf.find(self._marker, self._searched)
        if at >= 0:
            # the buffer becomes the response, cut in place: only what follows is copied
            self.leftover = bytes(self._buf[at + len(self._marker) :])
            del self._buf[at:]
            self.response, self._buf = self._buf, bytearray()
            self.done = True
            return
        if len(self._buf) > self._limit + len(self._marker):
            raise ProtocolError(f"a helper answer exceeds {self._limit} bytes", "oversize")
        if self._trailer_at < 0:
            self._trailer_at = self._buf.find(self._trailer, max(0, self._searched - 16))
        if self._trailer_at >= 0 and not self.answered:
            self.answered = self._buf.find(b"\n", self._trailer_at + len(self._trailer)) >= 0
        # the marker may straddle this piece and the next
        self._searched = max(0, len(self._buf) - len(self._marker) + 1)

    def give_up(self) -> bytearray:
        """Everything so far, as the response (the end line never came whole)."""
        self.response, self._buf = self._buf, bytearray()
        return self.response
