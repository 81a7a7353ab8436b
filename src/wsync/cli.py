"""The ``wsync`` command line: runs the command :mod:`wsync.cliargs` parsed, and turns
its outcome into output and an exit code, nothing else.

Every failure is one line on stderr (``wsync: error: ...``) and a documented
exit code (see :mod:`wsync.errors`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

# Only cheap imports up here: every command imports this module (wsync.launch
# does, once the signal policy is in place; in-process callers before they call
# main()).  asyncio, structlog and the engine are imported where they are used.
import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TextIO, TypeVar, cast

from wsync import interrupts, mallocopts, stdstreams
from wsync.cliargs import ParseError, build_parser, transport_options, wants_json_result
from wsync.errors import HostIOError, Interrupted, UsageError, WsyncError

if TYPE_CHECKING:
    from wsync.engine.api import PullOptions

T = TypeVar("T")


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
        restart=args.restart,
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


def _preconnect(args: argparse.Namespace) -> None:
    """Start OpenSSH's master connection before the pull's modules load (their import is
    most of a small pull's own time): the handshake runs beside it.  Any failure is left
    for the transport to report."""
    from wsync.errors import WsyncError
    from wsync.transports.openssh import preconnect
    from wsync.uri import parse

    with contextlib.suppress(WsyncError, ValueError, OSError):
        preconnect(parse(args.sandbox), transport_options(args))


#: this process ran a pull to its end (not a dry run): a stdout cut short afterwards
#: says DEST is complete all the same (see :func:`main`)
_PULLED = False


def cmd_pull(args: argparse.Namespace) -> int:
    if args.ssh_client == "openssh" and args.sandbox.startswith("ssh://"):
        _preconnect(args)
    from wsync.engine.api import PullResult, human_bytes
    from wsync.engine.pull import pull_uri
    from wsync.progress import describe_faults, plural, progress_display

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
    if not args.dry_run:
        global _PULLED  # (one process, one command: what its end may say)
        _PULLED = True
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
        mallocopts.tune()  # and its allocator, before the pull's threads start
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
    lost = stdstreams.lost_stdout()
    if lost is not None and code == 0:
        # only a pull that wrote DEST says so (not a dry run, not --help)
        done = "" if not _PULLED else "; the pull is done and DEST complete"
        print(
            f"wsync: error: what this command printed to stdout was cut short ({lost}){done}",
            file=sys.stderr,
        )
        code = HostIOError.exit_code
    if interrupts.current() is not None:
        interrupts.exit_process(code)
    return code


def _main(argv: list[str]) -> int:
    if argv and argv[0] in interrupts.UNGUARDED_COMMANDS:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ParseError as exc:
        if wants_json_result(argv):
            # the object every other usage error of a pull gives (stdout stayed empty)
            from wsync.engine.api import PullResult

            failed = PullResult.from_error("", "", UsageError(exc.message), 0.0)
            print(json.dumps(failed.to_json()))
        raise
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
