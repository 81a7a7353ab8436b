"""The ``wsync`` console script (``[project.scripts]`` in pyproject.toml): the signal
policy first, then the command.

pip's launcher runs ``from MODULE import FUNC`` before it calls anything.  With
``wsync.cli:main`` that import (the CLI, its argument grammar and theirs: 0.2 s on a
loaded machine) ran under Python's default SIGINT handler, so a Ctrl-C just after
``.venv/bin/wsync pull ...`` was a KeyboardInterrupt traceback and a process killed by
SIGINT, and a SIGTERM killed it with no word, where ``python -m wsync`` said one line
and exited 130.  This module imports no more than :mod:`wsync.__main__` does before the
policy is in place.
"""

from __future__ import annotations

import sys

from wsync.interrupts import install_for_cli
from wsync.stdstreams import tame


def main() -> int:
    """``python -m wsync`` and the ``wsync`` command."""
    tame()  # before the signal watcher opens its pipe: a closed fd 2 must not become it
    install_for_cli(sys.argv[1:])
    from wsync.cli import main as cli_main  # after the signal policy, on purpose

    return cli_main()
