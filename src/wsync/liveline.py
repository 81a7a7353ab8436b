"""The terminal status line of :mod:`wsync.progress`, drawn with rich.

Apart from that module so that rich is imported only where a terminal shows the line:
scripts, logs and the daemon never load it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import TextIO

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from wsync import interrupts
from wsync.engine.api import Progress
from wsync.progress import _SEP, REFRESH_PER_SECOND, RateWindow, fit, status_fields, terminal_width


class LiveLine:
    """The terminal status line: rich redraws it ``REFRESH_PER_SECOND`` times a second.

    Call it with each :class:`Progress` (from the event loop); it keeps a copy under a
    lock for the redraw thread.  ``close()`` erases the line.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.rates = RateWindow()
        self.lock = threading.Lock()
        self.latest = Progress()
        self.console = Console(file=self.stream, highlight=False, soft_wrap=False)
        self.live = Live(
            console=self.console,
            get_renderable=lambda: self,
            refresh_per_second=REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,  # stdout is the command's data, never the display's
            redirect_stderr=True,  # log lines print above the status line
        )
        self.live.start()
        # rich hid the cursor; a stop at once (os._exit) skips live.stop(), which shows it
        interrupts.set_terminal(b"\r\x1b[2K", b"\x1b[?25h")

    def __call__(self, p: Progress) -> None:
        copy = dataclasses.replace(p, faults=dict(p.faults))
        with self.lock:
            self.latest = copy
            self.rates.add(time.monotonic(), copy.bytes_fetched)

    def render(self, width: int) -> Text:
        """The status line as it is now, at most ``width - 1`` columns (the last
        column stays free: some terminals wrap on writing it)."""
        room = max(width - 1, 1)
        now = time.monotonic()
        with self.lock:
            p, rate = self.latest, self.rates.rate(now)
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        for i, field in enumerate(fit(status_fields(p, rate, now - self.started), room)):
            text.append((_SEP if i else "") + field.text, style=field.style)
        text.truncate(room, overflow="ellipsis")
        return text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Called by rich at every redraw, from its refresh thread."""
        yield self.render(min(options.max_width, terminal_width(self.stream, options.max_width)))

    def close(self) -> None:
        self.live.stop()
        interrupts.set_terminal(b"", b"")
