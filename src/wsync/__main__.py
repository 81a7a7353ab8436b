"""``python -m wsync``: sane std streams and the signal policy first, then everything else.

:mod:`wsync.interrupts` is installed before :mod:`wsync.cli` and its imports
load, so a Ctrl-C during start-up exits 130 with one line, not a traceback.
"""

import sys

from wsync.interrupts import install_for_cli
from wsync.stdstreams import tame

tame()  # before the signal watcher opens its pipe: a closed fd 2 must not become it
install_for_cli(sys.argv[1:])

from wsync.cli import main  # noqa: E402 - after the signal policy, on purpose

raise SystemExit(main())
