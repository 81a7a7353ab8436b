"""``wsync completion SHELL`` and ``wsync man``: generated from the argument parser.

Why generated and not hand-written: a hand-kept completion script or man page
drifts from ``--help`` the first time an option is added.  Both come from the
same :func:`wsync.cliargs.build_parser` (``full=True``, so the daemon commands'
options are in too), through two small single-purpose libraries:

* **shtab** writes static bash, zsh and fish completion scripts from an
  argparse parser (no Python runs at completion time, unlike argcomplete);
* **argparse-manpage** writes a roff page from the same parser.

Options that take a path (``type=Path`` or a FILE/DIR metavar) are tagged for
file or directory completion here, so no ``add_argument`` call has to know
about completion.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from wsync import __version__
from wsync.errors import HostIOError

#: the page's SEE ALSO section
SEE_ALSO = (
    "docs/daemon.md (the daemon, its HTTP API and deployment), docs/fidelity.md and\n"
    "docs/backends/ in the wsync source tree; wsync COMMAND --help."
)
#: one line for the man page's NAME section
SUMMARY = "pull an agent's workspace out of a remote sandbox, exact and resumable"


def _tag_paths(parser: argparse.ArgumentParser) -> None:
    """Mark path-taking options for file/directory completion, in every subparser."""
    import shtab

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _tag_paths(child)
            continue
        if action.dest == "staging_dir":
            continue  # a directory in the guest, not on this host
        metavar = str(action.metavar or "")
        if metavar == "DIR" or action.dest in ("state_dir", "dir", "dest"):
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        elif action.type is Path or metavar == "FILE":
            action.complete = shtab.FILE  # type: ignore[attr-defined]


def completion_script(shell: str) -> str:
    """The completion script for ``shell`` (bash, zsh or fish)."""
    import shtab

    from wsync.cliargs import build_parser

    parser = build_parser(full=True)
    _tag_paths(parser)
    script: str = shtab.complete(parser, shell=shell)
    return script


def man_page() -> str:
    """The wsync(1) manual page in roff."""
    from argparse_manpage.manpage import Manpage

    from wsync.cliargs import build_parser

    # argparse wraps usage lines to $COLUMNS; man fills the text itself, so
    # hand it one long line per usage instead of a terminal's worth of breaks
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "10000"
    try:
        parser = build_parser(full=True)
        page = Manpage(parser)
        page.description = SUMMARY
        page.source = f"wsync {__version__}"
        page.manual = "wsync manual"
        for heading, body in _epilog_sections(parser):
            page.add_section(heading, ">", body)
        page.add_section("see also", ">", _roff(SEE_ALSO))
        # argparse-manpage files the top-level epilog, the exit codes, under COMMENTS:
        # man-pages(7) calls that section EXIT STATUS
        text = str(page).replace(".SH COMMENTS\nexit codes:\n", ".SH EXIT STATUS\n", 1)
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return text


def _roff(text: str, raw: bool = True) -> str:
    """Plain text as roff with roff's specials escaped; ``raw``: kept as written (``.nf``)."""
    escaped = text.replace("\\", "\\\\").replace("-", "\\-")
    lines = [("\\&" + x) if x.startswith((".", "'")) else x for x in escaped.split("\n")]
    body = "\n".join(lines)
    return f".nf\n{body}\n.fi" if raw else body


def _epilog_sections(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """The subcommands' epilogs (argparse-manpage leaves them out), one section each.

    The exit-code table every epilog ends with is already the page's EXIT STATUS
    section, so it is cut; commands sharing an epilog share its section.
    """
    from wsync.cliargs import EPILOG_EXIT

    by_text: dict[tuple[str, bool], list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                body = (child.epilog or "").replace(EPILOG_EXIT, "").strip()
                raw = issubclass(child.formatter_class, argparse.RawDescriptionHelpFormatter)
                if body:
                    by_text.setdefault((body, raw), []).append(f"wsync {name}")
    return [(", ".join(names), _roff(body, raw)) for (body, raw), names in by_text.items()]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``wsync completion`` and ``wsync man``."""
    if args.command == "completion":
        sys.stdout.write(completion_script(args.shell))
        return 0
    text = man_page()
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        args.output.write_text(text, encoding="utf-8")
    except OSError as err:
        raise HostIOError(f"cannot write {args.output}: {err.strerror}") from None
    return 0
