"""``python -m wsync.daemon``: the same as ``wsync daemon``."""

import sys

from wsync.daemon.server import main

raise SystemExit(main(sys.argv[1:]))
