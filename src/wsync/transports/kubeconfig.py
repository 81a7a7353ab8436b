"""Cluster access from kubeconfig, found and merged the way kubectl does it.

Which files: ``--kubeconfig FILE`` alone (it must exist); else every file of ``$KUBECONFIG``
(an ``os.pathsep`` list; missing files are skipped, as kubectl does); else
``~/.kube/config``.  Merging follows client-go's rules: for each named cluster, user and
context, and for ``current-context``, the *first* file that sets it wins.

Then ``--context`` (else ``current-context``) picks the cluster, the user and the
namespace (default ``default``).  TLS is always verified against the cluster's CA
(``certificate-authority-data`` or ``certificate-authority``, alone: the system's trust
store is not consulted then; without either, the system's trust store) — the only way to
turn that off is ``insecure-skip-tls-verify: true`` (a YAML boolean, without a CA)
written in the kubeconfig itself, as kubectl honours it, and it is logged.  Credentials:
a bearer ``token`` or ``tokenFile``, a client certificate and key (data or files), or
basic auth.  ``exec`` and ``auth-provider`` plugins run foreign programs and are refused
with a clear message rather than half-supported.

Relative file paths in a kubeconfig are relative to the file that holds them.  The
credentials never appear in :attr:`KubeTarget.description`, errors or ``repr``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import logging
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from wsync.errors import UsageError
from wsync.transports.base import dns_spellable, header_safe

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "default"


@dataclasses.dataclass(frozen=True)
class KubeTarget:
    """What a client needs to reach one cluster as one user."""

    server: str
    context: str
    namespace: str
    ssl_context: ssl.SSLContext
    #: extra request headers (``Authorization``); secret
    headers: Mapping[str, str] = dataclasses.field(repr=False, default_factory=dict)
    insecure: bool = False

    @property
    def description(self) -> str:
        return f"{self.server} (context {self.context})"


@dataclasses.dataclass
class _Entry:
    """One named item with the directory of the file it came from (for relative paths)."""

    body: Mapping[str, Any]
    base: Path


def config_files(options: Mapping[str, Any]) -> list[Path]:
    """The kubeconfig files to merge, in precedence order."""
    explicit = options.get("kubeconfig")
    if explicit:
        path = _expand(str(explicit))
        if not path.is_file():
            raise UsageError(f"kubeconfig {path} does not exist")
        return [path]
    env = os.environ.get("KUBECONFIG", "")
    if env:
        found = [_expand(p) for p in env.split(os.pathsep) if p]
        files = [p for p in found if p.is_file()]
        if not files:
            raise UsageError("none of the files in $KUBECONFIG exists")
        return files
    home = _expand("~/.kube/config")
    if not home.is_file():
        raise UsageError(
            "no kubeconfig: set $KUBECONFIG, pass --kubeconfig or create ~/.kube/config"
        )
    return [home]


def _expand(name: str) -> Path:
    """``name`` with a leading ``~`` or ``~user`` expanded; a usage error where it cannot be
    (no such user, no home)."""
    try:
        return Path(name).expanduser()
    except RuntimeError as err:
        raise UsageError(f"kubeconfig: cannot expand {name[:80]!r}: {err}") from None


def _read(path: Path) -> Mapping[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as err:
        # not str(err): it quotes the line the parser stopped at, which may be a token's
        # or a password's; the parser's own words and the place are enough to find it
        said = []
        for text, mark in ((err.context, err.context_mark), (err.problem, err.problem_mark)):
            if text:
                at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
                said.append(f"{text}{at}")
        what = ": ".join(said) or type(err).__name__
        raise UsageError(f"cannot read kubeconfig {path}: not YAML: {what}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UsageError(f"cannot read kubeconfig {path}: {err}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UsageError(f"kubeconfig {path} is not a YAML mapping")
    return doc


def _named(
    doc: Mapping[str, Any], key: str, inner: str, path: Path
) -> dict[str, Mapping[str, Any]]:
    items = doc.get(key) or []
    if not isinstance(items, list):
        raise UsageError(f"kubeconfig {path}: {key} is not a list")
    out: dict[str, Mapping[str, Any]] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise UsageError(f"kubeconfig {path}: an entry of {key} has no name")
        body = item.get(inner) or {}
        if not isinstance(body, dict):
            raise UsageError(f"kubeconfig {path}: {key} {item['name']!r} is not a mapping")
        out.setdefault(item["name"], body)
    return out


def _load_data(entry: _Entry, data_key: str, file_key: str, what: str) -> bytes | None:
    """``X-data`` (base64) or the file ``X`` names, relative to its kubeconfig."""
    data = entry.body.get(data_key)
    if data:
        try:
            return base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError):
            raise UsageError(f"kubeconfig: {data_key} is not valid base64") from None
    name = entry.body.get(file_key)
    if name:
        path = _expand(str(name))
        if not path.is_absolute():
            path = entry.base / path
        try:
            return path.read_bytes()
        except (OSError, ValueError) as err:  # ValueError: a NUL in the name
            raise UsageError(f"kubeconfig: cannot read the {what} {path!r}: {err}") from None
    return None


def _load_cert_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """``ssl`` loads client certificates from files only: a private temp dir, removed now."""
    with tempfile.TemporaryDirectory(prefix="wsync-kube-") as tmp:
        os.chmod(tmp, 0o700)
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            ctx.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError) as err:
            raise UsageError(f"kubeconfig: bad client certificate or key: {err}") from None


def load(options: Mapping[str, Any]) -> KubeTarget:
    """Resolve ``options`` (``kubeconfig``, ``context``) to a :class:`KubeTarget`."""
    clusters: dict[str, _Entry] = {}
    users: dict[str, _Entry] = {}
    contexts: dict[str, _Entry] = {}
    current: str | None = None
    for path in config_files(options):
        doc = _read(path)
        base = path.parent
        for table, key, inner in (
            (clusters, "clusters", "cluster"),
            (users, "users", "user"),
            (contexts, "contexts", "context"),
        ):
            for name, body in _named(doc, key, inner, path).items():
                table.setdefault(name, _Entry(body, base))
        if current is None and doc.get("current-context"):
            current = str(doc["current-context"])
    name = str(options.get("context") or "") or current or ""
    if not name:
        raise UsageError("kubeconfig has no current-context; pass --context NAME")
    ctx_entry = contexts.get(name)
    if ctx_entry is None:
        known = ", ".join(sorted(contexts)) or "none"
        raise UsageError(f"kubeconfig has no context {name!r} (contexts: {known})")
    cluster_name = ctx_entry.body.get("cluster")
    cluster = clusters.get(str(cluster_name))
    if cluster is None:
        raise UsageError(f"context {name!r} names no known cluster ({cluster_name!r})")
    server = str(cluster.body.get("server") or "")
    try:
        parts = urllib.parse.urlsplit(server)
        parts.port  # noqa: B018 - raises ValueError for a port that is no port
        # a host the client cannot spell in DNS (IDNA) or a control character: named here,
        # not an internal error in the client's resolver
        if not server.isprintable() or not dns_spellable(parts.hostname or ""):
            raise ValueError("not printable, or no host name")
    except ValueError:
        parts = urllib.parse.urlsplit("")
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise UsageError(
            f"cluster {cluster_name!r}: server {server!r:.80} is not http(s)://HOST[:PORT]"
        )
    if parts.username or parts.password:
        raise UsageError(f"cluster {cluster_name!r}: the server URL carries credentials")
    if cluster.body.get("proxy-url"):
        raise UsageError(f"cluster {cluster_name!r}: proxy-url is not supported by wsync")
    namespace = str(ctx_entry.body.get("namespace") or DEFAULT_NAMESPACE)

    # kubectl's own rules: a YAML boolean only (``"false"`` is a string, and true to
    # Python), and never beside a CA (which one was meant?)
    insecure = cluster.body.get("insecure-skip-tls-verify")
    insecure = False if insecure is None else insecure  # left empty (null): unset
    if not isinstance(insecure, bool):
        raise UsageError(
            f"cluster {cluster_name!r}: insecure-skip-tls-verify must be true or false, "
            f"not {str(insecure)[:20]!r}"
        )
    ca = _load_data(cluster, "certificate-authority-data", "certificate-authority", "CA file")
    if ca is not None and insecure:
        raise UsageError(
            f"cluster {cluster_name!r}: insecure-skip-tls-verify is set beside a "
            "certificate-authority; remove one of them"
        )
    try:
        # the cluster's CA alone when it names one, as kubectl: added to the system's trust
        # store, any CA there (a TLS-inspecting proxy's) would vouch for the API server
        ssl_ctx = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cadata=None if ca is None else ca.decode("ascii")
        )
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"cluster {cluster_name!r}: bad certificate-authority: {err}") from None
    if ca is not None:
        # every certificate the kubeconfig names is a trust anchor, as in Go (kubectl):
        # an issuing intermediate alone, its root elsewhere, verifies there too
        ssl_ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if insecure:
        log.warning("kubeconfig cluster %s: insecure-skip-tls-verify is set", cluster_name)
        ssl_ctx.check_hostname = False
        ssl_ctx.verify_mode = ssl.CERT_NONE

    headers: dict[str, str] = {}
    user_name = ctx_entry.body.get("user")
    if user_name:
        user = users.get(str(user_name))
        if user is None:
            raise UsageError(f"context {name!r} names no known user ({user_name!r})")
        headers = _credentials(user, ssl_ctx, str(user_name))
    return KubeTarget(
        server=server.rstrip("/"),
        context=name,
        namespace=namespace,
        ssl_context=ssl_ctx,
        headers=headers,
        insecure=insecure,
    )


def _credentials(user: _Entry, ssl_ctx: ssl.SSLContext, name: str) -> dict[str, str]:
    body = user.body
    for plugin in ("exec", "auth-provider"):
        if body.get(plugin):
            raise UsageError(
                f"kubeconfig user {name!r} uses an {plugin} plugin, which wsync does not run; "
                "use a token (e.g. a service account's) or a client certificate"
            )
    cert = _load_data(user, "client-certificate-data", "client-certificate", "client certificate")
    key = _load_data(user, "client-key-data", "client-key", "client key")
    if (cert is None) != (key is None):
        raise UsageError(f"kubeconfig user {name!r}: a client certificate needs its key")
    if cert is not None and key is not None:
        _load_cert_chain(ssl_ctx, cert, key)
    token = body.get("token")
    if not token and body.get("tokenFile"):
        raw = _load_data(_Entry({"f": body["tokenFile"]}, user.base), "", "f", "token file")
        token = (raw or b"").decode("utf-8", "replace").strip()
    if token:
        token = header_safe(str(token).strip(), f"token of kubeconfig user {name!r}")
        return {"Authorization": f"Bearer {token}"}
    if body.get("username") and body.get("password"):
        pair = f"{body['username']}:{body['password']}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode("ascii")}
    return {}


def write_kubeconfig(path: Path, doc: Mapping[str, Any]) -> None:
    """Write a kubeconfig (it holds credentials) 0600, durably: temp, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(dict(doc), f, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
