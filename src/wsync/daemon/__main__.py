"""``python -m wsync.daemon``: the same as ``wsync daemon``."""

import sys

from wsync import mallocopts
from wsync.daemon import hold_sighup
from wsync.stdstreams import tame

tame()  # as `wsync daemon` does: a closed fd 2 gets /dev/null, a gone reader costs no job
mallocopts.tune()  # and its allocator (wsync.mallocopts)
hold_sighup()

from wsync.daemon.server import main  # noqa: E402 - after the signal is held

raise SystemExit(main(sys.argv[1:]))
