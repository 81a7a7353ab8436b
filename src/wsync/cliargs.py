"""The ``wsync`` command line's grammar: every command, option and value type, and help.

:func:`build_parser` is also what ``wsync completion`` and ``wsync man`` are generated
from (:mod:`wsync.clidoc`), so completions and the manual page match ``--help``.  What
the commands do is :mod:`wsync.cli`'s.  Only cheap imports here, as there: every command
loads this, a small pull's own time is mostly imports.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any, NoReturn

from wsync import __version__
from wsync.errors import EXIT_CODES

EPILOG_EXIT = "exit codes:\n" + "\n".join(
    f"  {code:>3}  {text}" for code, text in EXIT_CODES.items()
)

#: the --staging-dir help (pull and doctor share it)
STAGING_HELP = (
    "staging root in the guest (default /tmp/wsync-UID, private to the pulling user); "
    "created 0700 and refused (exit 5, naming it and its owner) when it is a symlink, "
    "another user's, writable by others, or beneath a directory others can change; "
    "refused (exit 2) when it overlaps the workspace"
)

VERBOSE_HELP = "log more: each retry with its fault kind and read size, and progress details"
DEBUG_HELP = "log everything -v does plus every guest call; print a traceback on errors"
COMPLETION_EPILOG = """install it:
  bash:  wsync completion bash > ~/.local/share/bash-completion/completions/wsync
  zsh:   wsync completion zsh > ~/.zfunc/_wsync   (with fpath+=(~/.zfunc) before compinit)
  fish:  wsync completion fish > ~/.config/fish/completions/wsync.fish
or for this shell only (bash):  source <(wsync completion bash)"""

SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """``4M``, ``512k``, ``10G``, ``1234`` → bytes."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1:] if raw[-1:] in SIZE_UNITS and raw[-1:] else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number) * SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4M, 512k, 10G)") from None
    if not math.isfinite(value):  # "inf", "1e400"
        raise argparse.ArgumentTypeError(f"not a finite size: {text!r}")
    if value < 1:  # "0.5" would be 0 bytes: every pull over the limit
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


#: the largest chunk, here and in the daemon's ``[limits] chunk_size`` (a chunk is read
#: and held whole; the guest's shell compares the size as a number of at most 19 digits)
MAX_CHUNK = 256 * 1024**2


def chunk_size(text: str) -> int:
    value = parse_size(text)
    if value > MAX_CHUNK:
        raise argparse.ArgumentTypeError(f"at most {MAX_CHUNK >> 20}M: {text!r}")
    return value


def size_or_zero(text: str) -> int:
    """:func:`parse_size`, where 0 (``0``, ``0M``, ...) means "none" (``--min-free 0``)."""
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError:
        if re.fullmatch(r"0+(\.0*)?[kmgt]?(i?b)?", text.strip().lower()):
            return 0
        # (parse_size's own complaint would say "at least 1 byte" of an option taking 0)
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (0: none; or 256M, ...)") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


#: the most reads in flight, here and in the daemon's ``[limits] parallel``: each is a
#: task and a buffer of up to a chunk (``--parallel 100000000`` ran the host out of memory)
MAX_PARALLEL = 64


def parallel(text: str) -> int:
    value = positive_int(text)
    if value > MAX_PARALLEL:
        raise argparse.ArgumentTypeError(f"at most {MAX_PARALLEL}: {text!r}")
    return value


def path_arg(text: str) -> Path:
    """A path argument, never empty: ``Path("")`` is the current directory, so an unset
    ``$DEST`` in a script named it, and ``--force`` then replaced it with the pull."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value):  # "nan" and "inf" parse as floats
        raise argparse.ArgumentTypeError(f"not a finite number of seconds: {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return value


def socket_seconds(text: str) -> float:
    """:func:`positive_seconds` a socket takes as its timeout (``1e10`` is an
    OverflowError there): at most a year."""
    value = positive_seconds(text)
    if value > 365 * 86400:
        raise argparse.ArgumentTypeError(f"at most a year ({365 * 86400}): {text!r}")
    return value


def staging_dir(text: str) -> str:
    """``--staging-dir``: text a guest can be given (a name that is not UTF-8 comes back
    in the probe's answer, whose records are UTF-8: the guest would be blamed)."""
    from wsync.errors import UsageError
    from wsync.uri import check_text

    try:
        return check_text(text, "the staging directory")
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def compress_level(text: str) -> int | None:
    from wsync.protocol.level import parse_level

    try:
        return parse_level(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not auto or a level 1-19: {text!r}") from None


def add_transport_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backend options")
    g.add_argument("--ssh-key", metavar="FILE", help="ssh: private key to authenticate with")
    g.add_argument(
        "--known-hosts",
        metavar="FILE",
        help="ssh: known_hosts file to verify the host key against "
        "(default ~/.ssh/known_hosts; host keys are always verified)",
    )
    g.add_argument("--ssh-config", metavar="FILE", help="ssh: config file (default ~/.ssh/config)")
    g.add_argument(
        "--ssh-client",
        choices=("asyncssh", "openssh"),
        help="ssh: asyncssh in this process (default), or OpenSSH's ssh(1) through one master "
        "connection: quicker to start (a small pull), and ~/.ssh/config as ssh reads it",
    )
    g.add_argument(
        "--sprites-url",
        metavar="URL",
        help="sprites: API base URL (default $SPRITES_API_URL or https://api.sprites.dev)",
    )
    g.add_argument(
        "--sprites-token-file",
        metavar="FILE",
        help="sprites: file holding the API token (default $SPRITES_TOKEN)",
    )
    g.add_argument(
        "--e2b-url",
        metavar="URL",
        help="e2b: envd base URL, {id} is the sandbox id "
        "(default $E2B_ENVD_URL or https://49983-{id}.$E2B_DOMAIN, domain e2b.app)",
    )
    g.add_argument(
        "--e2b-token-file",
        metavar="FILE",
        help="e2b: file holding the envd access token (default $E2B_ACCESS_TOKEN)",
    )
    g.add_argument(
        "--daytona-url",
        metavar="URL",
        help="daytona: the sandbox's toolbox proxy URL (default $DAYTONA_TOOLBOX_URL or "
        "https://proxy.app.daytona.io/toolbox)",
    )
    g.add_argument(
        "--daytona-token-file",
        metavar="FILE",
        help="daytona: file holding the API key (default $DAYTONA_API_KEY)",
    )
    g.add_argument(
        "--cloudflare-url",
        metavar="URL",
        help="cloudflare: Sandbox Bridge base URL (default $CLOUDFLARE_SANDBOX_URL)",
    )
    g.add_argument(
        "--cloudflare-token-file",
        metavar="FILE",
        help="cloudflare: file holding the Bridge token (default $CLOUDFLARE_SANDBOX_TOKEN)",
    )
    g.add_argument(
        "--docker-host",
        metavar="URL",
        help="docker: the Docker daemon, unix:///PATH or tcp://HOST[:PORT] "
        "(default $DOCKER_HOST or unix:///var/run/docker.sock)",
    )
    g.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="k8s: kubeconfig file (default $KUBECONFIG, a list too, else ~/.kube/config)",
    )
    g.add_argument("--context", metavar="NAME", help="k8s: kubeconfig context (default current)")
    g.add_argument(
        "--container", metavar="NAME", help="k8s: the pod's container (needed when it has several)"
    )
    g.add_argument(
        "--chaos",
        metavar="SPEC",
        help="inject transport faults, for demos and testing: 'all', or e.g. 'H=0.1,T=0.1,seed=1'",
    )


def transport_options(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {
        "ssh_key": args.ssh_key,
        "known_hosts": args.known_hosts,
        "ssh_config": args.ssh_config,
        "ssh_client": args.ssh_client,
        "sprites_url": args.sprites_url,
        "token_file": args.sprites_token_file,
        "e2b_url": args.e2b_url,
        "e2b_token_file": args.e2b_token_file,
        "daytona_url": args.daytona_url,
        "daytona_token_file": args.daytona_token_file,
        "cloudflare_url": args.cloudflare_url,
        "cloudflare_token_file": args.cloudflare_token_file,
        "docker_host": args.docker_host,
        "kubeconfig": args.kubeconfig,
        "context": args.context,
        "container": args.container,
        "chaos": args.chaos,
    }
    return {k: v for k, v in pairs.items() if v is not None}


class Parser(argparse.ArgumentParser):
    """argparse, as a careful user expects it of a tool that replaces directories:

    - no abbreviations: ``--fo`` was ``--force`` and ``--ful`` silently ``--full``;
      a mistyped option is an error, never another option;
    - a usage error is one line (README: "errors are one line"), naming where the usage
      is, instead of the whole usage block before it.

    Subparsers are made of the same class (argparse's default ``parser_class``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self._print_message(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise ParseError(message)


class ParseError(SystemExit):
    """The parser refused the command line (exit 2, its line already on stderr); the
    message is kept for ``pull --json``, whose result object says it too."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


def wants_json_result(argv: list[str]) -> bool:
    """``argv`` (as the parser refused it) asks ``pull`` for its ``--json`` object."""
    words = argv[: argv.index("--")] if "--" in argv else argv
    return "pull" in words and "--json" in words[words.index("pull") :]


def build_parser(full: bool = False) -> argparse.ArgumentParser:
    """The ``wsync`` parser.  ``full``: with the daemon commands' own options.

    ``main`` hands ``daemon``, ``status`` and ``jobs`` to their modules without
    importing them (the daemon pulls in uvicorn and FastAPI); the completion
    scripts and the man page need every option, so they ask for ``full``.
    """
    from wsync.engine.api import default_state_dir

    parser = Parser(
        prog="wsync",
        description="Pull an agent's workspace out of a remote sandbox, verified and resumable, "
        "over exec channels that lose bytes.",
        epilog=EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"wsync {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # the same flags after the subcommand (``wsync pull ... --debug``); SUPPRESS
    # keeps a subparser from resetting a flag given before the subcommand
    common = Parser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
    )
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "pull",
        parents=[common],
        help="copy a sandbox workspace into DEST, exactly",
        description="Copy the workspace named by SANDBOX into DEST. DEST ends up holding exactly "
        "the guest's tree (it is replaced atomically), or is left untouched on failure. "
        "Interrupted pulls resume where they stopped when run again.",
        epilog="SANDBOX forms:\n"
        "  local:PATH                        this machine (the embedded default)\n"
        "  ssh://[user@]host[:port]/PATH      OpenSSH server (~/.ssh/config honoured)\n"
        "  sprites://NAME/PATH               Sprites exec API ($SPRITES_TOKEN)\n"
        "  e2b://SANDBOX_ID/PATH             E2B envd ($E2B_ACCESS_TOKEN, $E2B_ENVD_URL)\n"
        "  daytona://SANDBOX_ID/PATH         Daytona toolbox ($DAYTONA_API_KEY, "
        "$DAYTONA_TOOLBOX_URL)\n"
        "  cloudflare://SANDBOX_ID/PATH      Cloudflare Sandbox Bridge ($CLOUDFLARE_SANDBOX_URL,\n"
        "                                    $CLOUDFLARE_SANDBOX_TOKEN)\n"
        "  docker://CONTAINER/PATH           Docker Engine API ($DOCKER_HOST, --docker-host)\n"
        "  k8s://NAMESPACE/POD/PATH          Kubernetes pods/exec (kubeconfig as kubectl finds\n"
        "                                    it; NAMESPACE '-' is the context's)\n\n" + EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sandbox", metavar="SANDBOX", help="sandbox URI including the workspace path")
    p.add_argument("dest", metavar="DEST", type=path_arg, help="destination directory on this host")
    p.add_argument("--json", action="store_true", help="print one JSON result object on stdout")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (default: a live line on a terminal, one line per phase "
        "otherwise, none with --json)",
    )
    p.add_argument(
        "--parallel", type=parallel, default=4, metavar="N", help="reads in flight (4, at most 64)"
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=3600.0,
        metavar="S",
        help="overall deadline (3600; 0=none)",
    )
    p.add_argument(
        "--call-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="deadline of one exec (60)",
    )
    p.add_argument(
        "--retries", type=positive_int, default=12, metavar="N", help="attempts per call (12)"
    )
    p.add_argument(
        "--chunk-size",
        type=chunk_size,
        default=4 * 1024**2,
        metavar="SIZE",
        help="chunk size, a multiple of 64K (4M, at most 256M)",
    )
    p.add_argument(
        "--state-dir",
        type=path_arg,
        default=None,
        metavar="DIR",
        help=f"journal and state (default {default_state_dir()})",
    )
    p.add_argument(
        "--staging-dir",
        type=staging_dir,
        default="",
        metavar="DIR",
        help=STAGING_HELP,
    )
    p.add_argument("--gzip", action="store_true", help="compress with gzip even if zstd exists")
    p.add_argument(
        "--compress-level",
        type=compress_level,
        default=None,
        metavar="auto|N",
        help="the guest's zstd level, 1-19 (gzip: 1-9; higher levels take more guest "
        "memory).  auto (the default) picks it from how fast this link carried reads: -1 "
        "on a fast link, where the guest's compressor is the bottleneck, up to -9 on a "
        "slow one, where every byte saved is time saved; the rate is remembered per link "
        "in the state directory",
    )
    p.add_argument(
        "--force", action="store_true", help="replace a non-empty DEST wsync did not write"
    )
    p.add_argument("--keep-staging", action="store_true", help="leave guest staging after success")
    p.add_argument(
        "--restart",
        action="store_true",
        help="forget what an interrupted or failed run of this pull left and start from the "
        "workspace as it is now (by default a run resumes that snapshot: after a full disk, "
        "make room and run again; after changing the workspace instead, use this)",
    )
    p.add_argument(
        "--exec-per-call",
        action="store_true",
        help="run every guest call as its own exec (by default, where the backend keeps a "
        "command open (ssh, local, docker, k8s, sprites, e2b), one guest helper answers many "
        "calls; it falls back to this by itself when it cannot)",
    )
    p.add_argument(
        "--best-effort",
        action="store_true",
        help="files that change every time they are read are taken as last read (listed in "
        "--json as unstable_files) instead of failing with exit 24",
    )
    p.add_argument(
        "--keep-prev",
        action="store_true",
        help="keep the replaced tree beside DEST as .NAME.wsync-prev (hard links to DEST's "
        "files) and start the next pull from it: a pull then costs what changed, not what "
        "DEST holds; DEST's files show 2 links, and removing DEST frees no space until "
        ".NAME.wsync-prev goes too",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="archive the whole workspace even when DEST holds an earlier pull of it "
        "(default: only what changed), relying on nothing the last pull recorded",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out entries matching PATTERN (rsync/.gitignore meaning; a leading ! "
        "re-includes, as in .gitignore; repeatable); they never leave the sandbox and go "
        "from DEST too",
    )
    p.add_argument(
        "--exclude-from",
        action="append",
        default=[],
        type=path_arg,
        metavar="FILE",
        help="read exclude patterns from FILE, one a line (# comments); - reads stdin",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list what a pull would change (like rsync -i) and write nothing to DEST; "
        "an interrupted pull still resumes after it",
    )
    p.add_argument(
        "--max-files",
        type=positive_int,
        default=5_000_000,
        metavar="N",
        help="refuse archives with more than this many entries (5000000; exit 7)",
    )
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=256 * 1024**3,
        metavar="SIZE",
        help="refuse archives that unpack to more than this (256G; exit 7)",
    )
    p.add_argument(
        "--min-free",
        type=size_or_zero,
        default=256 * 1024**2,
        metavar="SIZE",
        help="stop (exit 8, resumable) before DEST's or the state directory's filesystem "
        "drops below this much free space (256M; 0 = none)",
    )
    add_transport_options(p)

    d = sub.add_parser(
        "doctor",
        parents=[common],
        help="probe a sandbox and measure whether its exec channel loses bytes",
        description="Probe the guest's tools, then measure the backend the way the field reports "
        "do: random files of 16K..4M read back with one plain exec each (exit code trusted), "
        "next to wsync's verified read of the same files.",
    )
    d.add_argument(
        "sandbox",
        metavar="SANDBOX",
        help="sandbox URI (its workspace is probed, not written; the scratch files go in "
        "the guest's staging directory)",
    )
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--staging-dir", type=staging_dir, default="", metavar="DIR", help=STAGING_HELP)
    add_transport_options(d)

    m = sub.add_parser(
        "demo",
        parents=[common],
        help="show a lossy backend corrupting a naive copy while wsync comes back exact",
        description="Create a sample workspace, pull it through a backend with every field-report "
        "fault switched on, compare a naive single-stream copy with wsync pull, and print "
        "where the results are. Needs no setup.",
    )
    m.add_argument(
        "--backend",
        choices=("local", "sprites", "e2b", "daytona", "cloudflare", "docker", "k8s"),
        default="local",
        help="local: fault-injecting wrapper around local:; the others: that "
        "backend's emulator with its field faults on",
    )
    m.add_argument(
        "--dir", type=path_arg, default=None, help="work directory (default: a new temp dir)"
    )
    m.add_argument("--json", action="store_true", help="print the outcome as JSON")

    for name, text in (
        ("daemon", "run the long-lived pull daemon / sidecar (HTTP API)"),
        ("status", "show a running daemon's state, or one job's"),
        ("jobs", "list a running daemon's jobs"),
    ):
        # parsed by their own modules (main() hands them the rest of argv);
        # full=True copies their real options in, for completion and the man page
        if full:
            own = _delegated_parser(name)
            sub.add_parser(
                name,
                help=text,
                add_help=False,
                parents=[own],
                description=own.description,
                epilog=own.epilog,
            )
        else:
            sub.add_parser(name, help=text, add_help=False)

    c = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh or fish)",
        description="Print a completion script for SHELL on stdout, generated from wsync's own "
        "argument parser. Install it where the shell looks for completions.",
        epilog=COMPLETION_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell to complete for")
    man = sub.add_parser(
        "man",
        help="print the wsync(1) manual page (roff)",
        description="Print the wsync(1) manual page in roff on stdout, generated from wsync's "
        "own argument parser, so it always matches --help.",
        epilog="Read it with:  wsync man | man -l -\n"
        "Install it:    wsync man > /usr/local/share/man/man1/wsync.1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    man.add_argument(
        "-o", "--output", type=path_arg, metavar="FILE", help="write to FILE instead of stdout"
    )
    return parser


def _delegated_parser(name: str) -> Parser:
    """The real parser of ``wsync daemon|status|jobs`` (imported only when asked for)."""
    if name == "daemon":
        from wsync.daemon.server import build_parser as daemon_parser

        return daemon_parser()
    from wsync.daemon import client

    return client.status_parser() if name == "status" else client.jobs_parser()
