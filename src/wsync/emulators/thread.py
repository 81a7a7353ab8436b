"""Run a backend emulator on its own event loop in a background thread.

Every emulator is an asyncio server; ``wsync demo``, ``wsync doctor``, the benchmark and
the synchronous tests drive it from ordinary code, so each one is wrapped the same way::

    with EmulatorThread(root, faults=...) as emu:
        emu.create_sandbox("demo")
        pull_uri("scheme://demo/work", dest, opts, emu.transport_options())

Subclasses build their emulator and add what is particular to it (how a sandbox is
created, what its token looks like).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Generic, Protocol, Self, TypeVar


class Emulator(Protocol):
    """What every emulator offers its thread wrapper."""

    #: the fault configuration; replaced whole (an attribute swap is atomic)
    faults: Any

    @property
    def url(self) -> str: ...

    @property
    def stats(self) -> collections.Counter[str]: ...

    def transport_options(self) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


E = TypeVar("E", bound=Emulator)
F = TypeVar("F")


class BackgroundEmulator(Generic[E, F]):
    """An emulator ``E`` with faults ``F`` served from a daemon thread's event loop."""

    #: the thread's name, for stack dumps
    thread_name = "emulator"
    #: how long start and stop may take, seconds
    timeout = 60.0

    def __init__(self, emulator: E) -> None:
        self.emulator = emulator
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.emulator.url

    @property
    def stats(self) -> collections.Counter[str]:
        return self.emulator.stats

    def transport_options(self) -> dict[str, Any]:
        return self.emulator.transport_options()

    def set_faults(self, faults: F) -> None:
        """Swap the fault config; later requests draw from it (attribute swap is atomic)."""
        self.emulator.faults = faults

    def start(self) -> Self:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.emulator.start(), loop).result(self.timeout)
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        try:
            asyncio.run_coroutine_threadsafe(self.emulator.stop(), loop).result(self.timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
