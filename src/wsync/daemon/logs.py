"""Structured JSON logs for the daemon, with secrets redacted on the way out.

Why a redaction *processor* rather than care at each call site: the engine,
uvicorn and future code all log through the same chain, and one forgotten
``log.info(..., options=opts)`` must not leak a backend token.  The processor
masks values of secret-looking keys, every resolved secret string registered
with :func:`register_secret`, passwords embedded in URLs, and the value of any
credential header written out as text (``Authorization: Bearer ...``, as the
websockets library logs each handshake at DEBUG: a token a transport found by
itself, in its environment or a kubeconfig, is registered nowhere).  The
websockets loggers are kept at INFO in any case: at DEBUG they log every frame.

Every line of a pull carries ``job_id``, ``sandbox`` and ``snapshot``: the job
runner binds them with :mod:`structlog.contextvars`, which asyncio copies into
every task the engine spawns.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

REDACTED = "[redacted]"
_SECRET_KEYS = re.compile(r"(token|secret|password|passwd|authorization|api_key|credential)", re.I)
_URL_PASSWORD = re.compile(r"(//[^/:@\s]+):[^@/\s]+@")
#: a credential header written out as text: its value, to the end of the line
_HEADER = re.compile(
    r"((?:proxy-)?authorization|x-api-key|api-key|x-auth-token|cookie|set-cookie)"
    r"(\s*[:=]\s*)[^\r\n]+",
    re.I,
)
_secrets: set[str] = set()


def register_secret(value: str) -> None:
    """Mask ``value`` wherever it appears in a log line from now on."""
    if len(value) >= 4:
        _secrets.add(value)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        text = _URL_PASSWORD.sub(r"\1:" + REDACTED + "@", value)
        text = _HEADER.sub(r"\1\2" + REDACTED, text)
        for secret in _secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text
    if isinstance(value, dict):
        return {k: (REDACTED if _is_secret_key(k) else _scrub(v)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


def _is_secret_key(key: object) -> bool:
    return isinstance(key, str) and bool(_SECRET_KEYS.search(key)) and key != "token_file"


def redact(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: mask secret keys, registered secrets and URL passwords."""
    for key in list(event_dict):
        if _is_secret_key(key):
            event_dict[key] = REDACTED
        else:
            event_dict[key] = _scrub(event_dict[key])
    return event_dict


def configure(level: str = "info") -> None:
    """JSON lines on stderr for structlog *and* stdlib loggers (uvicorn, asyncio)."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact,
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    # at DEBUG websockets logs each frame and every handshake header (tokens included)
    logging.getLogger("websockets").setLevel(max(root.level, logging.INFO))
    # one line per request would drown the pull logs; the API has metrics instead
    access = logging.getLogger("uvicorn.access")
    access.handlers.clear()
    access.propagate = False
