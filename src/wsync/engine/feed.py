"""The ordered byte stream from journaled chunks to the extractor thread.

Chunks are fetched out of order by parallel readers but must be extracted in
order, while the pull is still running (extraction overlaps the transfer).
:class:`ChunkFeed` is a blocking, file-like reader over the journal's chunk
files: ``readinto`` waits until the next chunk in sequence has been published.
It also measures the whole stream (length and hash) over exactly the bytes the
extractor consumed, which is the end-to-end check: tar and zstd cannot detect
a stream cut at a member or frame boundary, so wsync must.

Memory stays bounded: only file names are queued, bytes are read from disk.
"""

from __future__ import annotations

import gzip
import io
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

import zstandard

from wsync.engine.api import ExtractLimits
from wsync.engine.extract import ExtractStats, FileHook, extract_tar_stream
from wsync.engine.tarstream import out_of_memory
from wsync.errors import HostileArchive, HostOutOfMemory, Interrupted
from wsync.protocol.hashing import Algorithm

#: refuse zstd frames that ask for a larger window: a hostile guest must not
#: make the host allocate gigabytes (zstd -3 uses 2 MiB, -19 uses 8 MiB)
MAX_WINDOW = 1 << 27

T = TypeVar("T")


class FeedAborted(Interrupted):
    template = "extraction stopped: {}"


class ChunkFeed(io.RawIOBase):
    def __init__(self, algorithm: Algorithm) -> None:
        super().__init__()
        self._cond = threading.Condition()
        self._ready: dict[int, Path] = {}
        self._next = 0
        self._total: int | None = None
        self._abort: str | None = None
        self._file: io.BufferedReader | None = None
        self._hash = algorithm.new()
        self.length = 0

    # -- producer side (event loop thread) -------------------------------------

    def publish(self, seq: int, path: Path) -> None:
        with self._cond:
            self._ready[seq] = path
            self._cond.notify_all()

    def finish(self, total: int) -> None:
        with self._cond:
            self._total = total
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        with self._cond:
            self._abort = reason
            self._cond.notify_all()

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()

    # -- consumer side (extractor thread) --------------------------------------

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while True:
            if self._file is None and not self._open_next():
                return 0
            assert self._file is not None
            n = self._file.readinto(buffer)
            if n:
                self._hash.update(memoryview(buffer)[:n])
                self.length += n
                return n
            self._file.close()
            self._file = None
            self._next += 1

    def _open_next(self) -> bool:
        path = self._wait_next()
        if path is None:
            return False
        self._file = path.open("rb")  # outside the lock: publish() never waits for a disk
        return True

    def _wait_next(self) -> Path | None:
        """The next chunk's file once it is published; None past the last chunk."""
        with self._cond:
            while True:
                if self._abort is not None:
                    raise FeedAborted(self._abort)
                if self._next in self._ready:
                    return self._ready.pop(self._next)
                if self._total is not None and self._next >= self._total:
                    return None
                self._cond.wait()

    def check_cancel(self) -> None:
        if self._abort is not None:
            raise FeedAborted(self._abort)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def extract_feed(
    feed: ChunkFeed,
    compressor: str,
    root: Path | int,
    limits: ExtractLimits,
    stats: ExtractStats | None = None,
    *,
    replace: bool = False,
    on_file: FileHook | None = None,
) -> ExtractStats:
    """Decompress and extract the whole feed into ``root`` (a path or an open
    directory fd, which stays open), then drain it.

    Draining matters: the decompressor may stop at tar's end-of-archive
    blocks, but the whole-stream hash must cover every byte of the stream.
    ``stats`` is counted into live (see :func:`extract_tar_stream`).
    """
    check: Callable[[], None] = feed.check_cancel

    def extract(stream: BinaryIO) -> ExtractStats:
        return extract_tar_stream(
            stream, root, limits, check_cancel=check, stats=stats, replace=replace, on_file=on_file
        )

    return consume_feed(feed, compressor, extract)


def consume_feed(feed: ChunkFeed, compressor: str, use: Callable[[BinaryIO], T]) -> T:
    """Decompress the whole feed into ``use`` (the extractor, or the manifest reader),
    then drain it (see :func:`extract_feed`)."""
    raw = io.BufferedReader(feed, 1 << 20)
    stream: BinaryIO
    try:
        if compressor in ("zstd", "zstdl"):  # zstdl: --long=25, a 32 MiB window
            dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
            reader = dctx.stream_reader(raw, read_across_frames=True, closefd=False)
            stream = cast(BinaryIO, reader)
        else:
            stream = cast(BinaryIO, gzip.GzipFile(fileobj=raw, mode="rb"))
        try:
            result = use(stream)
        except (MemoryError, zstandard.ZstdError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
            if out_of_memory(exc):
                raise HostOutOfMemory(f"decompressing a stream ({exc!r})") from exc
            raise HostileArchive(f"the archive does not decompress: {exc}") from exc
        while raw.read(1 << 20):
            pass
        return result
    finally:
        raw.close()
