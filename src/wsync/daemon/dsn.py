"""The PostgreSQL ``store`` URL: checked when the config loads, its password kept out of logs.

Why here and at load time: libpq (through psycopg) reports a URL it cannot
parse by quoting the offending token, and that token is the password when the
password has an un-encoded ``%`` or a space.  psycopg_pool's reconnect loop
logs that error about once a second on the ``psycopg.pool`` logger, which no
call site of wsync's controls.  So a URL libpq would reject, or would split in
the wrong place (an un-encoded ``@`` or ``/`` leaves part of the password in
the host or the port), is refused with a config error that never shows the
value, and the password of a good one is registered with the log redaction
(:func:`wsync.daemon.logs.register_secret`) in both its written
(percent-encoded) and decoded forms, so no later line shows it either way.

psycopg is imported inside the functions: only a daemon with a ``store`` needs it.
"""

from __future__ import annotations

import re
import urllib.parse

from wsync.digits import ascii_digits

#: the message of every refusal: what to do, never the value (it may hold the password)
BAD_STORE = (
    "cannot be parsed as a postgresql:// URL (the value is not shown: it may hold the "
    "password); percent-encode the password's special characters, e.g. '%' as %25, "
    "a space as %20, '@' as %40, '/' as %2F, ':' as %3A"
)
_QUERY_PASSWORD = re.compile(r"(?:^|&)password=([^&]*)")


def check_store_url(value: str) -> None:
    """Raise ValueError (with :data:`BAD_STORE`, not the value) if libpq would misread it."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(value)
    except Exception:  # psycopg.ProgrammingError quotes the token: never re-raise its text
        raise ValueError(BAD_STORE) from None
    hosts = str(params.get("host") or "")
    ports = str(params.get("port") or "")
    if "@" in hosts or any(p and not ascii_digits(p) for p in ports.split(",")):
        raise ValueError(BAD_STORE)


def store_secrets(value: str | None) -> list[str]:
    """The password(s) in the ``store`` URL, as written and decoded (best effort)."""
    if not value:
        return []
    found: set[str] = set()
    try:
        parts = urllib.parse.urlsplit(value)
        written = [parts.password or "", *_QUERY_PASSWORD.findall(parts.query)]
    except ValueError:
        written = []
    for raw in written:
        if raw:
            found.update((raw, urllib.parse.unquote(raw)))
    try:
        from psycopg.conninfo import conninfo_to_dict

        decoded = conninfo_to_dict(value).get("password")
    except Exception:  # a URL the config refused anyway
        decoded = None
    if decoded:
        found.add(str(decoded))
    return sorted(found)
