"""The daemon's configuration: a TOML file, overridable key by key from the environment.

Why pydantic-settings: one declarative schema gives type checks, defaults,
``WSYNC_…`` environment overrides (nested keys joined with ``__``, e.g.
``WSYNC_LIMITS__MAX_CONCURRENT=2``) and error locations for free, so a bad
config fails at start-up with one message naming the key instead of failing a
pull at 3 a.m.

Precedence, highest first: command-line flags (``--listen``, ``--state-dir``),
environment variables, the TOML file, the defaults below.

Relative paths *in the file* (``state_dir``, ``dest_roots``, ``[api]
token_file``, ``local_roots`` and a ``unix:`` listen path, a sandbox's
``dest`` and a ``local:`` uri) are taken relative to the file's own
directory, so a config kept in a checkout (``config.dev.toml``) starts from
any working directory; paths from flags and the environment must be absolute.
Because the environment silently wins over the file (the systemd unit sets
``WSYNC_STATE_DIR``), :func:`shadowed_keys` names every file key that a flag
or a variable overrides, and the daemon logs them at start-up.

Secrets never live in the file.  The API token comes from ``WSYNC_API_TOKEN``
or ``[api] token_file``; backend credentials are *references*
(``"env:NAME"`` or ``"file:/path"``) resolved only when a pull starts, so a
config dump or a log line can never carry them.
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from wsync.cliargs import MAX_CHUNK, MAX_PARALLEL
from wsync.daemon.configfile import ConfigError as ConfigError
from wsync.daemon.configfile import read_config_file
from wsync.daemon.confine import Forbidden
from wsync.daemon.dsn import check_store_url
from wsync.daemon.secretfile import read_secret_file
from wsync.digits import ascii_digits
from wsync.engine.api import ExtractLimits, PullOptions, default_state_dir
from wsync.engine.destdir import refuse_reserved
from wsync.engine.excludes import Excludes, check_pattern
from wsync.engine.fsutil import overlaps
from wsync.errors import UsageError
from wsync.protocol.records import printable
from wsync.transports.registry import SCHEMES
from wsync.uri import SandboxURI, parse

log = structlog.get_logger("wsync.daemon")

DEFAULT_LISTEN = "127.0.0.1:8477"
_LIMITS = ExtractLimits()
#: shortest API token accepted, from WSYNC_API_TOKEN or the token file alike
MIN_TOKEN_LENGTH = 16
SANDBOX_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Strict(BaseModel):
    # TOML has inf and nan: an endless timeout or interval is a typo, never a setting
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ApiConfig(_Strict):
    """Where the control API listens and how callers authenticate."""

    #: ``HOST:PORT`` (loopback by default) or ``unix:/path/to/socket``
    listen: str = DEFAULT_LISTEN
    #: file holding the bearer token (first line); ``WSYNC_API_TOKEN`` wins
    token_file: Path | None = None
    #: accept a sandbox URI in ``POST /v1/pulls`` instead of a configured name
    #: (off by default: a request can then only name what the operator configured)
    allow_uris: bool = False
    #: directories of this host that a ``local:`` URI in a request may name
    #: (its real path must lie under one); empty: ``local:`` requests are refused
    local_roots: list[Path] = Field(default_factory=list)

    @field_validator("local_roots")
    @classmethod
    def _check_local_roots(cls, value: list[Path]) -> list[Path]:
        for root in value:
            if not root.is_absolute():
                raise ValueError(f"{root}: must be an absolute path")
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class LimitsConfig(_Strict):
    """Concurrency, retry and extraction bounds applied to every pull."""

    #: pulls running at once, across all sandboxes
    max_concurrent: int = Field(default=4, ge=1, le=256)
    #: pulls running at once against one sandbox (overridable per sandbox)
    per_sandbox: int = Field(default=1, ge=1, le=64)
    #: chunk reads in flight within one pull
    parallel: int = Field(default=4, ge=1, le=MAX_PARALLEL)
    #: guest producer chunk size in bytes, a multiple of 64 KiB
    chunk_size: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=MAX_CHUNK)
    #: deadline of one guest exec, seconds
    call_timeout: float = Field(default=60.0, gt=0)
    #: deadline of a whole pull, seconds (0: none)
    pull_timeout: float = Field(default=3600.0, ge=0)
    #: attempts per guest call before the pull fails
    max_attempts: int = Field(default=12, ge=1, le=1000)
    #: extraction limits (see wsync.engine.api.ExtractLimits)
    max_files: int = Field(default=_LIMITS.max_files, ge=1)
    max_bytes: int = Field(default=_LIMITS.max_bytes, ge=1)
    min_free_bytes: int = Field(default=_LIMITS.min_free_bytes, ge=0)
    #: finished jobs kept in the job store (oldest dropped first)
    keep_finished_jobs: int = Field(default=1000, ge=10)
    #: with a PostgreSQL ``store``: pulls running at once across the whole fleet
    #: (0: no fleet-wide cap; ``max_concurrent`` still caps each daemon)
    fleet_max_concurrent: int = Field(default=0, ge=0, le=100_000)

    @field_validator("chunk_size")
    @classmethod
    def _check_chunk(cls, value: int) -> int:
        if value % (64 * 1024):
            raise ValueError("must be a multiple of 65536 (64 KiB)")
        return value


class SandboxConfig(_Strict):
    """One named sandbox: where its workspace is and where it lands."""

    uri: str
    #: default destination for pulls of this sandbox (inside a dest root)
    dest: Path | None = None
    #: scheduled pull period in seconds; unset means on-demand only
    interval: float | None = Field(default=None, gt=0)
    #: +/- fraction of ``interval`` added at random so sandboxes do not pull in lockstep
    jitter: float = Field(default=0.1, ge=0, le=1)
    #: per-sandbox concurrency (default: limits.per_sandbox)
    max_concurrent: int | None = Field(default=None, ge=1, le=64)
    parallel: int | None = Field(default=None, ge=1, le=MAX_PARALLEL)
    chunk_size: int | None = Field(default=None, ge=64 * 1024, le=MAX_CHUNK)
    #: non-secret transport options, e.g. ssh_key / known_hosts paths, sprites_url
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    #: secret transport options by reference only: "env:NAME" or "file:/path"
    secrets: dict[str, str] = Field(default_factory=dict)
    #: paths left out of every pull of this sandbox, ``--exclude`` patterns (rsync meaning:
    #: ``*.pyc``, ``/build``, ``node_modules/``, ``logs/**``); checked at load, exit 2 if bad
    exclude: list[str] = Field(default_factory=list)
    #: keep the replaced tree beside DEST for the next pull (``--keep-prev``): periodic
    #: incremental pulls then cost what changed, not what DEST holds
    keep_prev: bool = False
    #: the guest's zstd level 1-19 (``--compress-level``); unset: chosen from the link's
    #: measured speed, remembered per sandbox host in the state directory
    compress_level: int | None = Field(default=None, ge=1, le=19)
    #: testing/demo knob: run this sandbox through the fault-injecting transport
    #: (wsync.chaos spec: "all", "all,seed=7", "H=0.1,T=0.05", ...); never in production
    chaos: str | None = None

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, value: str) -> str:
        try:
            check_uri(value)
        except UsageError as err:
            raise ValueError(str(err)) from None
        return value

    @field_validator("chunk_size")
    @classmethod
    def _check_chunk(cls, value: int | None) -> int | None:
        if value is not None and value % (64 * 1024):
            raise ValueError("must be a multiple of 65536 (64 KiB)")
        return value

    @field_validator("options")
    @classmethod
    def _check_options(
        cls, value: dict[str, str | int | float | bool]
    ) -> dict[str, str | int | float | bool]:
        for key in value:
            if key == "token" or key.endswith("_token"):
                # never echo the value: it is a pasted secret
                raise ValueError(
                    f"{key}: tokens go in [secrets] by reference ('env:NAME' or 'file:/path'), "
                    "never as a plain option"
                )
        return value

    @field_validator("secrets")
    @classmethod
    def _check_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        for key, ref in value.items():
            kind, _, target = ref.partition(":")
            if kind not in ("env", "file") or not target:
                # never echo the value: it may be a pasted secret
                raise ValueError(
                    f"{key}: secrets are given by reference, 'env:NAME' or 'file:/path'"
                )
            if kind == "file" and not target.startswith("/"):
                raise ValueError(f"{key}: file reference must be an absolute path")
        return value

    @field_validator("exclude")
    @classmethod
    def _check_exclude(cls, value: list[str]) -> list[str]:
        for i, pattern in enumerate(value):
            try:
                check_pattern(pattern, f"[{i}]")
            except UsageError as err:
                raise ValueError(str(err)) from None
        return value

    @field_validator("chaos")
    @classmethod
    def _check_chaos(cls, value: str | None) -> str | None:
        if value is not None:
            from wsync.chaos import FaultPlan

            try:
                FaultPlan.parse(value)
            except UsageError as err:
                raise ValueError(str(err)) from None
        return value


_TOML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("toml_data")


class DaemonConfig(BaseSettings):
    """The whole daemon configuration (see ``config.example.toml``)."""

    model_config = SettingsConfigDict(
        env_prefix="WSYNC_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )

    #: jobs database, engine journals and the daemon's address file
    state_dir: Path = Field(default_factory=default_state_dir)
    #: where jobs live: unset (SQLite ``STATE_DIR/jobs.db``, one daemon) or
    #: ``postgresql://…`` (a fleet of daemons sharing jobs, leases and schedules)
    store: str | None = None
    #: engine journals and the record of DESTs wsync wrote (default STATE_DIR/engine);
    #: a fleet needs it on the filesystem every daemon shares, so a takeover resumes
    engine_dir: Path | None = None
    #: with a PostgreSQL store: seconds a claimed job stays ours without a renewal
    lease_seconds: float = Field(default=30.0, ge=1.0, le=3600.0)
    #: destinations must resolve inside one of these directories
    dest_roots: list[Path] = Field(default_factory=list)
    #: seconds SIGTERM waits for in-flight pulls to checkpoint before exiting anyway
    shutdown_grace: float = Field(default=10.0, gt=0, le=300)
    log_level: str = "info"
    #: the API token itself; only meant to come from the env var WSYNC_API_TOKEN
    api_token: SecretStr | None = None
    api: ApiConfig = Field(default_factory=ApiConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    sandboxes: dict[str, SandboxConfig] = Field(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = InitSettingsSource(settings_cls, init_kwargs=_TOML_DATA.get({}))
        return (init_settings, env_settings, toml)

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("must be one of debug, info, warning, error")
        return value.lower()

    @field_validator("state_dir")
    @classmethod
    def _check_state_dir(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("must be an absolute path")
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str | None) -> str | None:
        if value is not None and value and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (unset: SQLite in the state dir)")
        if value:
            check_store_url(value)  # never echoes the value: it may hold the password
        return value or None

    @field_validator("engine_dir")
    @classmethod
    def _check_engine_dir(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("must be an absolute path")
        return value

    @field_validator("dest_roots")
    @classmethod
    def _check_roots(cls, value: list[Path]) -> list[Path]:
        for root in value:
            if not root.is_absolute():
                raise ValueError(f"{root}: must be an absolute path")
        return value

    @model_validator(mode="after")
    def _check_sandboxes(self) -> DaemonConfig:
        for name, box in self.sandboxes.items():
            if not SANDBOX_NAME.match(name):
                raise ValueError(
                    f"sandboxes.{name}: name must match {SANDBOX_NAME.pattern} "
                    "(it is used in metrics labels and logs)"
                )
            if box.dest is not None:
                try:
                    check_dest(str(box.dest), self.dest_roots, self.own_dirs)
                except UsageError as err:
                    raise ValueError(f"sandboxes.{name}.dest: {err}") from None
            if box.interval is not None and box.dest is None:
                raise ValueError(f"sandboxes.{name}: a scheduled sandbox (interval) needs a dest")
        if self.engine_dir is not None:
            for root in self.dest_roots:
                if overlaps(self.engine_dir, root):
                    # a request naming the journals as its DEST would replace them
                    raise ValueError(
                        f"engine_dir: must lie outside every dest root (it overlaps {root})"
                    )
        if self.store is not None and self.engine_dir is None:
            raise ValueError(
                "engine_dir: a PostgreSQL store (a fleet) needs engine_dir on the filesystem "
                "every daemon shares, so that a daemon taking over a job resumes its journal"
            )
        return self

    @property
    def own_dirs(self) -> tuple[Path, Path]:
        """The daemon's state and the engine's (journals, registry): never a DEST."""
        return self.state_dir, self.engine_state_dir

    @property
    def engine_state_dir(self) -> Path:
        """The engine's state directory: journals and the DEST registry."""
        return self.engine_dir or self.state_dir / "engine"

    # -- derived values ---------------------------------------------------

    def api_token_value(self) -> str:
        """The bearer token, from the environment or the token file.

        Both sources get the same minimum length: a short token is guessable
        whichever way it arrived.
        """
        if self.api_token is not None and self.api_token.get_secret_value().strip():
            token = self.api_token.get_secret_value().strip()
            if len(token) < MIN_TOKEN_LENGTH:
                raise ConfigError(
                    f"WSYNC_API_TOKEN: the token must be at least {MIN_TOKEN_LENGTH} characters"
                )
            return _sendable(token, "WSYNC_API_TOKEN")
        if self.api.token_file is None:
            raise ConfigError(
                "api.token_file: no API token; set [api] token_file or WSYNC_API_TOKEN"
            )
        try:
            text, too_open = read_secret_file(self.api.token_file)
        except FileNotFoundError:
            raise ConfigError(
                f"api.token_file: {self.api.token_file} does not exist; create it "
                f"(at least {MIN_TOKEN_LENGTH} characters), set WSYNC_API_TOKEN, or, "
                "only to try wsync out, start with --dev to generate one"
            ) from None
        except OSError as err:
            raise ConfigError(
                f"api.token_file: cannot read {self.api.token_file}: {err.strerror}"
            ) from None
        except UnicodeDecodeError:
            # (a UTF-16 file, say: the decoder's own message quotes a byte of the secret)
            raise ConfigError(f"api.token_file: {self.api.token_file} is not UTF-8 text") from None
        if too_open:
            # refused the way ssh refuses a private key others can read: whoever can
            # read this file holds the whole API (no documented recipe leaves it so)
            raise ConfigError(f"api.token_file: {too_open}")
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        if len(token) < MIN_TOKEN_LENGTH:
            raise ConfigError(
                f"api.token_file: the token must be at least {MIN_TOKEN_LENGTH} characters"
            )
        return _sendable(token, "api.token_file")

    def pull_options(self, sandbox: SandboxConfig | None) -> PullOptions:
        """Engine options for one pull of ``sandbox`` (None: an ad-hoc URI)."""
        lim = self.limits
        parallel = sandbox.parallel if sandbox and sandbox.parallel else lim.parallel
        chunk = sandbox.chunk_size if sandbox and sandbox.chunk_size else lim.chunk_size
        return PullOptions(
            state_dir=self.engine_state_dir,
            parallel=parallel,
            timeout=lim.pull_timeout,
            call_timeout=lim.call_timeout,
            max_attempts=lim.max_attempts,
            chunk_size=chunk,
            limits=ExtractLimits(
                max_files=lim.max_files, max_bytes=lim.max_bytes, min_free_bytes=lim.min_free_bytes
            ),
            excludes=Excludes(tuple(sandbox.exclude)) if sandbox else Excludes.none(),
            keep_prev=sandbox.keep_prev if sandbox else False,
            compress_level=sandbox.compress_level if sandbox else None,
        )

    def sandbox_concurrency(self, name: str) -> int:
        box = self.sandboxes.get(name)
        if box is not None and box.max_concurrent:
            return box.max_concurrent
        return self.limits.per_sandbox


def _sendable(token: str, where: str) -> str:
    """``token`` if a client can send it in an ``Authorization`` header and the daemon
    read it back the same: printable ASCII.  Header bytes are read as Latin-1, so a token
    with other characters (``é``, ``€``) never matched what any client sent, and the
    daemon ran with an API nobody could use.  Never echoed."""
    if any(not " " <= c <= "~" for c in token):
        raise ConfigError(
            f"{where}: the token may hold only printable ASCII characters (it travels in an "
            "HTTP header); generate one with: head -c 32 /dev/urandom | base64"
        )
    return token


def resolve_transport_options(box: SandboxConfig | None) -> dict[str, Any]:
    """Build transport options, resolving secret references now (never stored, never logged)."""
    if box is None:
        return {}
    options: dict[str, Any] = dict(box.options)
    for key, ref in box.secrets.items():
        kind, _, target = ref.partition(":")
        if kind == "env":
            value = os.environ.get(target)
            if not value:
                raise ConfigError(f"secret {key!r}: environment variable {target} is not set")
        else:
            try:
                text, finding = read_secret_file(Path(target))
            except OSError as err:
                raise ConfigError(f"secret {key!r}: cannot read {target}: {err.strerror}") from None
            except UnicodeDecodeError:
                # never the decoder's message: it quotes a byte of the secret
                raise ConfigError(f"secret {key!r}: {target} is not UTF-8 text") from None
            if finding:
                # warned, not refused: a Kubernetes secret volume or a docker secret
                # is mounted 0644 by default, and refusing would fail such a setup
                # outright; the API token file, which no recipe leaves open, is refused
                log.warning("secret.file_too_open", secret=key, problem=finding)
            value = text.strip()
        options[key] = value
    if box.chaos:
        options["chaos"] = box.chaos
    return options


def secret_values(box: SandboxConfig | None) -> list[str]:
    """The resolved secrets of ``box`` (best effort), so log redaction can mask them."""
    if box is None or not box.secrets:
        return []
    try:
        opts = resolve_transport_options(box)
    except ConfigError:
        return []
    return [str(opts[key]) for key in box.secrets if opts.get(key)]


def parse_listen(value: str) -> tuple[str, int] | str:
    """``HOST:PORT`` → (host, port); ``unix:/path`` → path.  Raises ValueError."""
    if value.startswith("unix:"):
        path = value[len("unix:") :]
        if not path.startswith("/"):
            raise ValueError("unix socket path must be absolute (unix:/run/wsync/api.sock)")
        return path
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not ascii_digits(port) or int(port) > 65535:
        raise ValueError(f"{value!r}: expected HOST:PORT or unix:/path")
    return host, int(port)


def check_uri(raw: str) -> SandboxURI:
    """Parse a sandbox URI and check its scheme is known; raises UsageError."""
    return parse(raw, SCHEMES)


def check_dest(raw: str, roots: list[Path], keep_out: Sequence[Path] = ()) -> Path:
    """Return the resolved DEST if it lies inside an allowed root, else raise.

    Refuses relative paths and ``..`` components outright (422), then resolves
    symlinks in the existing part of the path so a link planted inside a root
    cannot point the pull elsewhere (403, :class:`DestForbidden`).  A DEST that is,
    holds or lies in one of ``keep_out`` (the daemon's own state: a pull replaces DEST
    whole) is refused too (403), also inside a root: ``dest_roots = ["/home/agent"]``
    with the default state directory under it is an ordinary setup.
    """
    if not raw or "\x00" in raw:
        raise UsageError("dest is empty or contains a NUL byte")
    path = Path(raw)
    if not path.is_absolute():
        raise UsageError(f"dest {raw!r} must be an absolute path")
    if ".." in path.parts:
        raise UsageError(f"dest {raw!r} must not contain '..'")
    refuse_reserved(path)
    if not roots:
        raise DestForbidden("no dest_roots are configured, so no destination is allowed")
    try:
        resolved = path.resolve(strict=False)
    except (RuntimeError, OSError) as err:  # a symlink loop (RuntimeError before 3.13)
        raise DestForbidden(f"dest {raw!r} cannot be resolved: {err}") from None
    refuse_reserved(resolved)  # a link in a root may name one too
    try:
        # a link in a root may also lead to a name that is not UTF-8, which no job store
        # holds exactly (and which failed as an internal error, ending a schedule)
        str(resolved).encode("utf-8")
    except UnicodeEncodeError:
        raise DestForbidden(f"dest {raw!r} resolves to a path that is not UTF-8") from None
    for kept in keep_out:
        if overlaps(resolved, kept.resolve(strict=False)):
            raise DestForbidden(
                f"dest {raw!r} overlaps the daemon's state directory {kept}: "
                "a pull replaces DEST whole"
            )
    # (before the containment check: with nested roots, one root lies inside another,
    # and a pull replaces DEST whole, every DEST in a root it holds included)
    if any(root.resolve(strict=False).is_relative_to(resolved) for root in roots):
        raise DestForbidden(
            f"dest {raw!r} is a dest root itself, or holds one: a pull replaces DEST "
            "whole, so name a directory inside the root"
        )
    for root in roots:
        real_root = root.resolve(strict=False)
        if resolved != real_root and resolved.is_relative_to(real_root):
            return resolved
    allowed = ", ".join(str(r) for r in roots)
    raise DestForbidden(f"dest {raw!r} resolves outside the allowed roots ({allowed})")


class DestForbidden(Forbidden):
    """DEST is well-formed but outside every allowed root (HTTP 403)."""


def format_validation_error(err: pydantic.ValidationError) -> str:
    """One line per problem: ``key.path: message`` (never the offending value)."""
    lines = []
    for item in err.errors(include_url=False, include_input=False):
        loc = ".".join(str(part) for part in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


#: top-level keys of the schema, the only names a ``WSYNC_…`` variable can set
_FIELDS = frozenset(DaemonConfig.model_fields)
#: the flags ``wsync daemon`` turns into overrides, by key
_FLAG_NAMES = {"state_dir": "--state-dir", "api.listen": "--listen"}


def shadowed_keys(
    path: Path | None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """Keys set in the file that a flag or an environment variable overrides.

    Each entry reads ``key (WSYNC_NAME)`` or ``key (--flag)``.  The daemon
    logs them at start-up so that, e.g., the systemd unit's
    ``WSYNC_STATE_DIR`` winning over the file's ``state_dir`` is visible.
    """
    if path is None:
        return []
    data = read_config_file(path)
    found: list[str] = []
    env = os.environ if environ is None else environ
    for name in sorted(env):
        if not name.upper().startswith("WSYNC_"):
            continue
        parts = name[len("WSYNC_") :].lower().split("__")
        if parts[0] not in _FIELDS:
            continue
        node: Any = data
        for part in parts:
            match = (
                next((k for k in node if k.lower() == part), None)
                if isinstance(node, dict)
                else None
            )
            if match is None:
                break
            node = node[match]
        else:
            found.append(f"{'.'.join(parts)} ({name})")
    for key, flag in _FLAG_NAMES.items():
        top, _, sub = key.partition(".")
        given = (overrides or {}).get(top)
        if sub:
            given = given.get(sub) if isinstance(given, dict) else None
        in_file = data.get(top)
        if sub:
            in_file = in_file.get(sub) if isinstance(in_file, dict) else None
        if given is not None and in_file is not None:
            found.append(f"{key} ({flag})")
    return found


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Read ``path`` (TOML), apply env and ``overrides``; raise ConfigError on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_config_file(path)
    token = _TOML_DATA.set(data)
    try:
        return DaemonConfig(**dict(overrides or {}))
    except pydantic.ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    except SettingsError as err:  # a WSYNC_* variable that is not JSON where JSON is due
        hint = _settings_hint(str(err))
        raise ConfigError(f"{printable(str(err), 300)}{hint}") from None
    finally:
        _TOML_DATA.reset(token)


def _settings_hint(message: str) -> str:
    """How to write a complex value in the environment (pydantic-settings reads lists
    and tables from a variable as JSON: ``WSYNC_DEST_ROOTS=/srv/ws`` is not one)."""
    if "error parsing value" in message:
        return " (lists and tables are JSON in the environment: WSYNC_DEST_ROOTS='[\"/srv/ws\"]')"
    return ""
