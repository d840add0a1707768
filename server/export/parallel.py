"""An export's pages, encoded, in order: on forked worker processes when the machine has cores to spare.

Turning rows into rollouts and rollouts into JSON or Arrow is Python's work (about a tenth of a
millisecond per rollout) and holds the GIL, so a second core takes a second process. The pages (ranges
of chat ids: ``page_bounds``) are dealt out, page k to worker k mod n, each sent to its worker as soon as
its bounds are read (the workers are forked first and connect meanwhile); each worker reads its pages on
a database connection of its own, encodes them (an ``Encoder``) and writes them to a pipe; the parent
takes the pages from the pipes in order and writes them (JSON lines: moved by the kernel from the pipe
into the file, ``os.splice``), so the output is the same as one process writing page after page
(``export_pages`` with one worker does exactly that, in the calling process). A worker is a fork of the
parent (nothing to import; only the version registry is pickled to it) and holds one page at a time;
the parent holds at most one page of each worker, so memory stays flat however long the export.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from server.export.fastpage import keep_freed_memory
from server.export.page_rollouts import Chat
from server.export.pages import Connection, PageQueries, connect, iter_page_bounds, page_chats, read_paths
from server.export.query import Decoders, ExportFilters, PolicyPaths
from server.export.writers import PageWriter

CHATS_PER_PAGE = 250  # the unit of work of a worker, and of the Parquet writer (a row group)
MAX_WORKERS = 4  # past a few, the database rather than Python sets the pace
WORKER_HEAP = 64 << 20  # blocks below this size come from (and go back to) a worker's heap


class Encoder(Protocol):
    """Turns a page's chats into rollouts, and those into bytes that its ``PageWriter`` takes."""

    def add_chats(
        self, chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths
    ) -> tuple[int, int]:
        """Build and encode the rollouts of ``chats`` (``page_chats``); returns (rollouts, records)."""
        ...

    def payload(self) -> list[Any]:
        """The rollouts added, encoded: bytes-like chunks to be concatenated."""
        ...


@dataclass(frozen=True)
class Job:
    queries: PageQueries
    filters: ExportFilters
    paths: PolicyPaths | None  # None: read at the export's start, on its connection (``read_paths``)
    encoder: Callable[[], Encoder]


@dataclass(frozen=True)
class Page:
    chats: int
    rollouts: int
    records: int
    payload: list[Any]  # bytes-like chunks


@dataclass
class Stats:
    """What the last export's workers report: their number and each one's peak memory growth (MiB)."""

    workers: int = 0
    peak_growth_mb: list[float] = field(default_factory=list)


LAST = Stats()


async def export_pages(job: Job, writer: PageWriter, workers: int) -> AsyncIterator[Page]:
    """Encodes the export's pages and writes them, in order; on ``workers`` processes (one: in this
    process). Yields each page once written (its payload then empty).

    The workers are forked first, and connect while this process reads the version registry and the
    pages' bounds on its own connection; it sends them the registry, then each page's bounds as soon as
    it is read. A worker left without pages (fewer pages than workers) ends without any."""
    forked = _Workers(job, workers) if workers > 1 else None
    bounds: list[tuple[str, str]] = []
    total = 0
    try:
        conn = await connect(job.queries, blocking=True)
        try:
            if job.paths is None:
                job = replace(job, paths=await read_paths(conn, job.queries))
            if forked is not None:
                forked.begin(job.paths)
            async for page_bounds in iter_page_bounds(conn, job.queries, CHATS_PER_PAGE):
                if forked is not None:
                    forked.send(total, page_bounds)
                else:
                    bounds.append(page_bounds)
                total += 1
            if forked is not None:
                forked.sent()
        finally:
            await conn.close()
    except BaseException:
        if forked is not None:
            forked.stop()
        raise
    LAST.workers, LAST.peak_growth_mb = (len(forked.procs) if forked else 0), []
    pages = _inline(job, bounds, writer) if forked is None else _forked(forked, total, writer)
    async for page in pages:
        yield page


WORKERS_ENV = "TOKENTRAIL_EXPORT_WORKERS"


def default_workers() -> int:
    """``TOKENTRAIL_EXPORT_WORKERS`` if set, else one worker per core this process may run on, up to
    ``MAX_WORKERS``; elsewhere than on Linux one, this process (its workers are forks, and the writing
    takes Linux's pipes and ``splice``). A program that runs other threads should export with one: a
    fork copies only the forking thread, and a lock another thread held at that instant stays held in
    the child (the test suite, which serves in threads, sets it)."""
    if (given := os.environ.get(WORKERS_ENV)) is not None:
        if not given.strip().isdigit() or int(given) < 1:
            raise ValueError(f"{WORKERS_ENV} must be a whole number of at least 1, not {given!r}")
        return int(given)
    if sys.platform != "linux":
        return 1
    return min(MAX_WORKERS, len(os.sched_getaffinity(0)))


async def _inline(job: Job, bounds: list[tuple[str, str]], writer: PageWriter) -> AsyncIterator[Page]:
    conn = await connect(job.queries, blocking=True)
    try:
        for after, last in bounds:
            page = await _encode_page(job, conn, after, last)
            writer.write_page(page.payload)
            yield page
    finally:
        await conn.close()


async def _encode_page(job: Job, conn: Connection, after: str, last: str) -> Page:
    encoder = job.encoder()
    chats = [chat async for chat in page_chats(conn, job.queries, after, last)]
    assert job.paths is not None, "read by export_pages"
    rollouts, records = encoder.add_chats(chats, job.filters, job.queries.decoders, job.paths)
    return Page(len(chats), rollouts, records, encoder.payload())


# A frame on a worker's pipe: kind, chats, rollouts, records, payload length; then the payload.
_HEADER = struct.Struct("<5q")
_PAGE, _ERROR, _DONE = range(3)


async def _forked(workers: _Workers, total: int, writer: PageWriter) -> AsyncIterator[Page]:
    n = len(workers.procs)
    target = writer.splice_target() if hasattr(os, "splice") else None
    try:
        if target is None:
            workers.read_ahead()  # pages are read as they come: a worker never waits for this process's writing
        for seq in range(total):
            if target is not None:
                page = await asyncio.to_thread(workers.splice_page, seq % n, target)
            else:
                page = await asyncio.to_thread(workers.next_page, seq % n)
                await asyncio.to_thread(writer.write_page, page.payload)
                workers.written(seq % n)
            yield Page(page.chats, page.rollouts, page.records, [])
        LAST.peak_growth_mb = await asyncio.to_thread(workers.peak_growth)
    finally:
        workers.stop()


class _Workers:
    """The forked worker processes, each with the pipe it reads its pages' bounds from (``send``) and
    the pipe it writes its frames to."""

    def __init__(self, job: Job, n: int) -> None:
        import fcntl

        ctx = multiprocessing.get_context("fork")
        pipes = [os.pipe() for _ in range(n)]
        inputs = [os.pipe() for _ in range(n)]
        self.procs: list[Any] = []
        for (_, w), (r, _) in zip(pipes, inputs, strict=True):
            with contextlib.suppress(AttributeError, OSError):  # a larger pipe: fewer hand-offs (Linux)
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
            others = [fd for pipe in (*pipes, *inputs) for fd in pipe if fd not in (w, r)]
            self.procs.append(ctx.Process(target=_worker, args=(job, r, w, others), daemon=True))
            self.procs[-1].start()
        self.readers = [os.fdopen(r, "rb", buffering=0) for r, _ in pipes]
        for (_, w), (r, _) in zip(pipes, inputs, strict=True):
            os.close(w)
            os.close(r)
        self.inputs: list[int] = [w for _, w in inputs]
        self.queues: list[queue.Queue[tuple[int, Page] | BaseException]] = []
        self.slots: list[threading.Semaphore] = []
        self.threads: list[threading.Thread] = []

    def begin(self, paths: PolicyPaths | None) -> None:
        """The export's version registry, to every worker (read before any page)."""
        blob = pickle.dumps(paths)
        for k in range(len(self.procs)):
            try:
                _write_all(self.inputs[k], _PATHS.pack(len(blob)) + blob)
            except BrokenPipeError:
                self._ended(k)

    def send(self, seq: int, bounds: tuple[str, str]) -> None:
        """Page ``seq`` goes to worker ``seq mod n`` (a worker reads its bounds as they come: never blocks)."""
        after, last = (b.encode() for b in bounds)
        k = seq % len(self.procs)
        try:
            _write_all(self.inputs[k], _BOUNDS.pack(len(after), len(last)) + after + last)
        except BrokenPipeError:  # the worker is gone: say which, and how it ended
            self._ended(k)

    def sent(self) -> None:
        """No more pages: each worker ends after its last one."""
        for fd in self.inputs:
            os.close(fd)
        self.inputs = []

    def read_ahead(self) -> None:
        """Reads each worker's frames on a thread of its own, at most one frame ahead of the writing."""
        self.queues = [queue.Queue() for _ in self.procs]
        self.slots = [threading.Semaphore(1) for _ in self.procs]
        self.threads = [threading.Thread(target=self._read_all, args=(k,), daemon=True) for k in range(len(self.procs))]
        for thread in self.threads:
            thread.start()

    def _read_all(self, k: int) -> None:
        try:
            while True:
                self.slots[k].acquire()  # freed once the frame before is written
                kind, page = self._frame(k)
                self.queues[k].put((kind, page))
                if kind == _DONE:
                    return
        except BaseException as exc:  # handed to the writing side, which raises it
            self.queues[k].put(exc)

    def next_page(self, k: int) -> Page:
        """The next page of worker ``k``; ``written(k)`` once it is written lets the next one be read."""
        return self._take(k)[1]

    def written(self, k: int) -> None:
        self.slots[k].release()

    def splice_page(self, k: int, target: int) -> Page:
        """The next page of worker ``k``, its bytes moved by the kernel into ``target`` (no copy here)."""
        kind, chats, rollouts, records, size = self._header(k)
        if kind != _PAGE:
            self._fail(k, kind, self._read_exact(k, size))
        while size:
            moved = os.splice(self.readers[k].fileno(), target, size)
            if not moved:
                self._ended(k)
            size -= moved
        return Page(chats, rollouts, records, [])

    def peak_growth(self) -> list[float]:
        """Each worker's peak memory growth (MiB), from its last frame."""
        return [float(b"".join(self._take(k)[1].payload) or "nan") for k in range(len(self.procs))]

    def _take(self, k: int) -> tuple[int, Page]:
        if not self.queues:
            return self._frame(k)
        item = self.queues[k].get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _frame(self, k: int) -> tuple[int, Page]:
        kind, chats, rollouts, records, size = self._header(k)
        payload = self._read_exact(k, size)
        if kind == _ERROR:
            self._fail(k, kind, payload)
        return kind, Page(chats, rollouts, records, [payload])

    def _header(self, k: int) -> tuple[int, int, int, int, int]:
        kind, chats, rollouts, records, size = _HEADER.unpack(self._read_exact(k, _HEADER.size))
        return kind, chats, rollouts, records, size

    def _read_exact(self, k: int, size: int) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = self.readers[k].readinto(view[got:])
            if not n:
                self._ended(k)
            got += n
        return buf

    def _fail(self, k: int, kind: int, payload: bytearray) -> None:
        text = payload.decode(errors="replace") if kind == _ERROR else f"an unexpected frame ({kind})"
        raise RuntimeError(f"export worker {self.procs[k].pid} failed:\n{text}")

    def _ended(self, k: int) -> None:
        proc = self.procs[k]
        proc.join(1)
        raise RuntimeError(f"export worker {proc.pid} ended early (exit code {proc.exitcode})")

    def stop(self) -> None:
        self.sent()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for thread, slot in zip(self.threads, self.slots, strict=True):
            while thread.is_alive():  # it ends at the end of its pipe (the worker is gone), given a slot
                slot.release()
                thread.join(0.01)
        for reader in self.readers:
            reader.close()


def _worker(job: Job, bounds: int, out: int, inherited: list[int]) -> None:
    """A worker process: encodes the pages whose bounds it reads from ``bounds``, writes them to ``out``,
    then a last frame with its peak memory."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the export (and its workers)
    for fd in inherited:
        os.close(fd)
    # Rollouts are trees of dicts, lists and arrays that reference counting frees; the cycle collector
    # would only rescan the page's rows again and again.
    gc.disable()
    # A page's buffers (megabytes) are allocated and freed page after page: left to glibc's defaults they
    # are mapped and unmapped each time, and every page faults its memory in again (~15% of a worker's CPU)
    keep_freed_memory(WORKER_HEAP)
    base = _reset_peak_rss()
    try:
        asyncio.run(_work(job, _bounds(bounds), out))
    except BaseException:
        _write_frame(out, _ERROR, Page(0, 0, 0, [traceback.format_exc().encode()]))
        return
    peak = _status_kb("VmHWM")
    growth = b"" if base is None or peak is None else f"{(peak - base) / 1024:.1f}".encode()
    _write_frame(out, _DONE, Page(0, 0, 0, [growth]))


def _bounds(fd: int) -> queue.Queue[Any]:
    """What the parent sends (``_Workers.begin``, ``send``), read on a thread as it comes (the parent
    never waits for a pipe to drain): the version registry, then each page's bounds; None after the
    last (the parent's end of the pipe closed)."""
    received: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        with os.fdopen(fd, "rb") as fh:
            if len(head := fh.read(_PATHS.size)) == _PATHS.size:
                received.put(pickle.loads(fh.read(_PATHS.unpack(head)[0])))
                while len(head := fh.read(_BOUNDS.size)) == _BOUNDS.size:
                    a, b = _BOUNDS.unpack(head)
                    received.put((fh.read(a).decode(), fh.read(b).decode()))
        received.put(None)

    threading.Thread(target=read, daemon=True).start()
    return received


async def _work(job: Job, received: queue.Queue[Any], out: int) -> None:
    """A worker's pages: its connection opened at once (while the parent reads the bounds), then the
    version registry and each page's bounds as they come. Reads block: nothing else runs on this loop."""
    conn = await connect(job.queries, blocking=True)
    try:
        warm_up = getattr(job.encoder(), "warm_up", None)
        if warm_up is not None:
            warm_up()
        paths = received.get()
        if paths is None:  # no page for this worker (the parent's pipe closed)
            return
        job = replace(job, paths=paths)
        while (page := received.get()) is not None:
            _write_frame(out, _PAGE, await _encode_page(job, conn, *page))
    finally:
        await conn.close()


_PATHS = struct.Struct("<I")  # first on a worker's input pipe: the length of the pickled registry, then it
_BOUNDS = struct.Struct("<II")  # then each page's bounds: their lengths, then their UTF-8


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_frame(out: int, kind: int, page: Page) -> None:
    size = sum(len(chunk) for chunk in page.payload)
    chunks: list[Any] = [_HEADER.pack(kind, page.chats, page.rollouts, page.records, size), *page.payload]
    i = 0
    while i < len(chunks):  # writev takes at most IOV_MAX buffers and may write part of them
        written = os.writev(out, chunks[i : i + _IOV_MAX])
        while i < len(chunks) and written >= len(chunks[i]):
            written -= len(chunks[i])
            i += 1
        if written:
            chunks[i] = memoryview(chunks[i])[written:]


_IOV_MAX = 1024


def _reset_peak_rss() -> int | None:
    """Resets the peak resident memory to the current (Linux); returns the current, in KiB."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
