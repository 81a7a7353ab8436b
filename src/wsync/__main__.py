"""``python -m wsync``: sane std streams and the signal policy first, then everything else.

:mod:`wsync.interrupts` is installed before :mod:`wsync.cli` and its imports
load, so a Ctrl-C during start-up exits 130 with one line, not a traceback
(:mod:`wsync.launch`, which the ``wsync`` console script runs too).
"""

from wsync.launch import main

raise SystemExit(main())
