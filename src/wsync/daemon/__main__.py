"""``python -m wsync.daemon``: the same as ``wsync daemon``."""

import sys

from wsync.daemon import hold_sighup

hold_sighup()

from wsync.daemon.server import main  # noqa: E402 - after the signal is held

raise SystemExit(main(sys.argv[1:]))
