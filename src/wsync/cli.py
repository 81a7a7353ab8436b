"""The ``wsync`` command line: argument parsing and exit codes, nothing else.

Every failure is one line on stderr (``wsync: error: ...``) and a documented
exit code (see :mod:`wsync.errors`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

# Only cheap imports up here: the signal policy (wsync.interrupts) must be in
# place before anything slow is imported, and the console script imports this
# module before it calls main().  asyncio, structlog and the engine are
# imported where they are used.
import argparse
import io
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar, cast

from wsync import __version__, interrupts, stdstreams
from wsync.errors import EXIT_CODES, Interrupted, UsageError, WsyncError

if TYPE_CHECKING:
    from wsync.engine.api import PullOptions

T = TypeVar("T")

_EPILOG_EXIT = "exit codes:\n" + "\n".join(
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
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return int(value)


def size_or_zero(text: str) -> int:
    """:func:`parse_size`, where 0 (``0``, ``0M``, ...) means "none" (``--min-free 0``)."""
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError:
        if re.fullmatch(r"0+(\.0*)?[kmgt]?(i?b)?", text.strip().lower()):
            return 0
        raise


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


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


def build_parser(full: bool = False) -> argparse.ArgumentParser:
    """The ``wsync`` parser.  ``full``: with the daemon commands' own options.

    ``main`` hands ``daemon``, ``status`` and ``jobs`` to their modules without
    importing them (the daemon pulls in uvicorn and FastAPI); the completion
    scripts and the man page need every option, so they ask for ``full``.
    """
    from wsync.engine.api import default_state_dir

    parser = argparse.ArgumentParser(
        prog="wsync",
        description="Pull an agent's workspace out of a remote sandbox, verified and resumable, "
        "over exec channels that lose bytes.",
        epilog=_EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"wsync {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # the same flags after the subcommand (``wsync pull ... --debug``); SUPPRESS
    # keeps a subparser from resetting a flag given before the subcommand
    common = argparse.ArgumentParser(add_help=False)
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
        "                                    it; NAMESPACE '-' is the context's)\n\n"
        + _EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sandbox", metavar="SANDBOX", help="sandbox URI including the workspace path")
    p.add_argument("dest", metavar="DEST", type=Path, help="destination directory on this host")
    p.add_argument("--json", action="store_true", help="print one JSON result object on stdout")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (default: a live line on a terminal, one line per phase "
        "otherwise, none with --json)",
    )
    p.add_argument(
        "--parallel", type=positive_int, default=4, metavar="N", help="reads in flight (4)"
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
        "--chunk-size", type=parse_size, default=4 * 1024**2, metavar="SIZE", help="chunk size (4M)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"journal and state (default {default_state_dir()})",
    )
    p.add_argument(
        "--staging-dir",
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
        "(default: only what changed)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out entries matching PATTERN (rsync/.gitignore meaning; repeatable); "
        "they never leave the sandbox and go from DEST too",
    )
    p.add_argument(
        "--exclude-from",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="read exclude patterns from FILE, one a line (# comments)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list what a pull would change (like rsync -i) and write nothing",
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
    d.add_argument("sandbox", metavar="SANDBOX", help="sandbox URI (its path is used for scratch)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--staging-dir", default="", metavar="DIR", help=STAGING_HELP)
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
        "--dir", type=Path, default=None, help="work directory (default: a new temp dir)"
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
        "-o", "--output", type=Path, metavar="FILE", help="write to FILE instead of stdout"
    )
    return parser


def _delegated_parser(name: str) -> argparse.ArgumentParser:
    """The real parser of ``wsync daemon|status|jobs`` (imported only when asked for)."""
    if name == "daemon":
        from wsync.daemon.server import build_parser as daemon_parser

        return daemon_parser()
    from wsync.daemon import client

    return client.status_parser() if name == "status" else client.jobs_parser()


class _CurrentStderr(io.TextIOBase):
    """``sys.stderr`` as it is at each write, not as it was at setup: while the live
    progress line runs it points at rich's proxy, which prints log lines above the
    status line instead of through it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def setup_logging(verbose: bool, debug: bool) -> None:
    """Warnings by default; ``-v`` adds info (each retry of a guest call with its fault
    kind and read size), ``--debug`` adds debug (every guest call: which, its nonce,
    bytes, duration).  All on stderr, so ``--json`` keeps stdout to the result."""
    import logging

    if "structlog" not in sys.modules:
        # structlog.dev loads rich's traceback renderer (and pygments' lexers with it)
        # when rich is installed: 50-70 ms of every run, for exception output we never
        # ask structlog for.  It is kept from finding rich while it loads; the progress
        # line imports rich itself afterwards (structlog keeps plain tracebacks for the
        # whole process, also where wsync.cli.main runs inside another program)
        absent = object()
        rich = sys.modules.get("rich", absent)
        sys.modules["rich"] = None  # type: ignore[assignment]
        try:
            import structlog
        finally:
            if rich is absent:
                del sys.modules["rich"]
            else:
                sys.modules["rich"] = rich  # type: ignore[assignment]
    import structlog

    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )


def run_async(coro_factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine; SIGINT and SIGTERM cancel it and it ends as :class:`Interrupted`.

    The first signal cancels the task from the signal watcher thread (see
    :mod:`wsync.interrupts`, which also bounds how long winding down may take
    and makes a second signal exit at once).  Once a signal has come, any
    failure is reported as the interruption (exit 130): a cancelled pull can
    fail in other ways on its way out (a killed read, a TaskGroup that saw an
    error while cancelling) and the user asked for a stop, not a diagnosis.
    A pull that *returns* after a signal has swapped DEST into place: that is
    a success, and exits 0 (see :func:`wsync.engine.pull.pull`).
    """
    import asyncio

    stopper = interrupts.current()

    async def main() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if stopper is not None and task is not None:

            def cancel() -> None:  # runs on the watcher thread
                loop.call_soon_threadsafe(task.cancel)

            stopper.set_target(cancel)
        try:
            return await coro_factory()
        except asyncio.CancelledError as exc:
            raise _stopped(exc) from None

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:  # only where no stopper is installed (off the main thread)
        raise Interrupted("stopped by the user; run the same command again to resume") from None
    except Exception as exc:
        if stopper is not None and stopper.received and not isinstance(exc, Interrupted):
            raise _stopped(exc) from exc
        raise
    finally:
        if stopper is not None:
            # from here a signal has nothing to cancel: it exits at once
            stopper.set_target(None)


def _stopped(exc: BaseException) -> Interrupted:
    """A stop by signal, carrying what the pull had done till then (its ``so_far``)."""
    stop = Interrupted("stopped by a signal; run the same command again to resume")
    stop.so_far = getattr(exc, "so_far", None) or {}
    return stop


def pull_options(args: argparse.Namespace) -> PullOptions:
    """The engine's options from ``wsync pull``'s arguments; UsageError for a bad one."""
    from wsync.engine.api import ExtractLimits, PullOptions, default_state_dir
    from wsync.engine.excludes import Excludes

    if args.state_dir is None and not os.environ.get("XDG_STATE_HOME"):
        # as root, HOME=/nonexistent made /nonexistent/.local/state, HOME= /.local/state;
        # an unset HOME is the passwd entry's (a root service without User=)
        home = os.environ.get("HOME")
        if home is None:
            home = os.path.expanduser("~")
        if not os.path.isabs(home) or not os.path.isdir(home):
            raise UsageError(
                f"no home directory for the default state directory (HOME={home!r}); "
                "pass --state-dir DIR or set XDG_STATE_HOME"
            )
    options = PullOptions(
        state_dir=args.state_dir or default_state_dir(),
        parallel=args.parallel,
        timeout=args.timeout,
        call_timeout=args.call_timeout,
        max_attempts=args.retries,
        chunk_size=args.chunk_size,
        staging_root=args.staging_dir,
        force=args.force,
        keep_staging=args.keep_staging,
        helpers=not args.exec_per_call,
        best_effort=args.best_effort,
        keep_prev=args.keep_prev,
        compressor="gzip" if args.gzip else "zstd",
        compress_level=args.compress_level,
        limits=ExtractLimits(
            max_files=args.max_files, max_bytes=args.max_bytes, min_free_bytes=args.min_free
        ),
        full=args.full,
        excludes=Excludes.from_options(args.exclude, args.exclude_from),
        dry_run=args.dry_run,
    )
    if options.chunk_size % (64 * 1024):
        raise UsageError("--chunk-size must be a multiple of 64K")
    return options


def cmd_pull(args: argparse.Namespace) -> int:
    from wsync.engine.api import PullResult
    from wsync.engine.pull import pull_uri
    from wsync.progress import describe_faults, human_bytes, plural, progress_display

    # --json: stdout holds exactly the result, stderr only errors and warnings
    bar = None
    started = time.monotonic()
    try:
        options = pull_options(args)  # its usage errors get the JSON result too
        bar = progress_display(sys.stderr, enabled=not (args.json or args.no_progress))
        result = run_async(
            lambda: pull_uri(
                args.sandbox, args.dest, options, transport_options(args), on_progress=bar
            )
        )
    except Exception as exc:
        if bar:
            bar.close()
        if args.json:
            failed = PullResult.from_error(args.sandbox, args.dest, exc, time.monotonic() - started)
            print(json.dumps(failed.to_json()))
        raise
    if bar:
        bar.close()
    if args.json:
        print(json.dumps(result.to_json()))
    elif args.dry_run:
        for line in result.changes:
            print(line)
        print(
            f"dry run ({result.mode}): {plural(result.changed_files, 'change')}, "
            f"{plural(result.deleted_files, 'deletion')}; DEST not written",
            file=sys.stderr,
        )
    else:
        note = (
            " (finished an interrupted pull: DEST is the workspace as that pull listed it;"
            " changes since come with the next pull)"
            if result.reconciled
            else ""
        )
        resumed = f", {result.resumed_chunks} resumed" if result.resumed_chunks else ""
        faults = f" ({describe_faults(result.faults)})" if result.faults else ""
        if result.mode == "incremental":
            note += (
                f" (incremental: {plural(result.changed_files, 'change')}, "
                f"{plural(result.deleted_files, 'deletion')})"
            )
        print(
            f"pulled {args.sandbox} -> {result.dest}: {plural(result.files, 'file')}, "
            f"{human_bytes(result.bytes)} archive in {plural(result.chunks, 'chunk')}{resumed}, "
            f"{plural(result.retries, 'retry', 'retries')}{faults}, "
            f"{plural(len(result.warnings), 'warning')}, {result.elapsed_s:.1f}s{note}",
            file=sys.stderr,
        )
    for warning in result.warnings:
        print(f"wsync: warning: {warning}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``wsync`` command.

    As the process entry point (``argv`` None) it keeps the signal policy until
    the process is gone and ends it with :func:`wsync.interrupts.exit_process`
    (a signal in the last milliseconds would otherwise meet the default action
    the interpreter restores while it finalizes, and kill the process with no
    word and status -2).  Called with an explicit ``argv`` (in-process) it
    returns, and gives the caller its own signal handlers back.
    """
    if argv is None:  # the process's own streams (not a caller's, in-process); idempotent
        stdstreams.tame()
    args = list(sys.argv[1:] if argv is None else argv)
    installed = interrupts.install_for_cli(args)
    if argv is not None:
        try:
            return _main(args)
        finally:
            if installed is not None and not installed.received:
                interrupts.uninstall(installed)
    try:
        code = _main(args)
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    if interrupts.current() is not None:
        interrupts.exit_process(code)
    return code


def _main(argv: list[str]) -> int:
    if argv and argv[0] in interrupts.UNGUARDED_COMMANDS:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.verbose, args.debug)
    try:
        if args.command == "pull":
            return cmd_pull(args)
        if args.command == "doctor":
            from wsync.doctor import run_doctor

            return run_doctor(args, transport_options(args))
        if args.command == "demo":
            from wsync.demo import run_demo

            return run_demo(args)
        if args.command in ("completion", "man"):
            from wsync import clidoc

            return clidoc.run(args)
        raise UsageError(f"unknown command {args.command}")  # pragma: no cover
    except WsyncError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"wsync: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        # a relative DEST, local: path or --state-dir made absolute (getcwd() fails): one
        # place for all of them
        if isinstance(exc, FileNotFoundError) and _cwd_gone():
            print(
                "wsync: error: the current directory no longer exists, and a relative path "
                "was given (or defaulted); cd somewhere that does, or give absolute paths",
                file=sys.stderr,
            )
            return UsageError.exit_code
        print(
            f"wsync: internal error: {type(exc).__name__}: {exc} (re-run with --debug)",
            file=sys.stderr,
        )
        return 1


def _cwd_gone() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def _delegate(command: str, rest: list[str]) -> int:
    if command == "daemon":
        from wsync.daemon import hold_sighup

        hold_sighup()  # before the server's imports: a reload must not kill a starting daemon
        from wsync.daemon.server import main as daemon_main

        return daemon_main(rest)
    from wsync.daemon import client

    return client.status_main(rest) if command == "status" else client.jobs_main(rest)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
