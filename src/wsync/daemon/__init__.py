"""The wsync daemon: a host service and sidecar that keeps workspaces pulled.

Layers, thinnest first: :mod:`~wsync.daemon.server` (process, signals,
sd_notify), :mod:`~wsync.daemon.api` (HTTP), :mod:`~wsync.daemon.jobs`
(scheduler and runner over the engine), :mod:`~wsync.daemon.store` (SQLite),
:mod:`~wsync.daemon.config`, :mod:`~wsync.daemon.metrics`,
:mod:`~wsync.daemon.logs`; :mod:`~wsync.daemon.client` is the CLI side of the
API (``wsync status``, ``wsync jobs``).  See docs/daemon.md.
"""
