"""KVStore: the KV cache's second tier, full blocks in an LMDB environment on disk.

Blocks are written as they are computed (a background thread; the step only copies them out of
the cache tensors) and read back for prefix hits the memory tier no longer holds, after a restart
too. A key is the model's digest (weights, dtypes, block size, tensor-parallel layout: the builder's
`kv_model_digest`), this rank's number and the block's chained hash (core/kv_cache_manager.py);
a value is a header (magic, CRC-32 and length of the payload) and the block's bytes, K then V of
each cache tensor. A value whose header or checksum does not hold is dropped, never loaded.

The store keeps its size within a budget, least recently used blocks evicted first (a second
database keeps each block's last use and size, so that the order survives restarts). Every failure
of the store (a read-only or full disk, a damaged file) degrades to recomputing, with a warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lmdb

from pagedllm.config import KVOffloadConfig
from pagedllm.core.step import KVStoreReport

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 of the payload, its length
MAGIC = b"PKV1"
ENTRY = struct.Struct("<QQ")  # a block's last use (ns since the epoch) and its value's size
# Writes in flight beyond this many bytes are dropped rather than queued: the step never waits.
MAX_PENDING_BYTES = 512 << 20
# Stores open in this process by their real path: LMDB forbids opening one environment twice in
# a process (its locks are per process), so a second engine on the same directory goes without.
_OPEN: set[str] = set()
WRITE_RETRY_S = 30.0  # how long saves are dropped after a write failed


class KVStore:
    def __init__(self, config: KVOffloadConfig, rank: int = 0) -> None:
        self.config = config
        self.prefix = config.model_digest + rank.to_bytes(2, "little")
        self.writable = True
        self.path = os.path.realpath(config.path)
        if self.path in _OPEN:
            logger.warning("KV offload: %s is already open in this process: this engine goes without it", self.path)
            self.env = None
        else:
            self.env = self._open(self.path)
        if self.env is not None:
            _OPEN.add(self.path)
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> its value's size, least recent first
        self._bytes = 0
        self._counters = KVStoreReport()  # what it did since the last report (no loads: the runner's)
        self._pending = 0  # bytes queued for the writer
        self._touched: list[bytes] = []  # keys read since the writer last recorded uses
        self._bad: list[bytes] = []  # keys found damaged, which the writer deletes
        self._queue: queue.Queue[tuple[bytes, int, Any] | None] = queue.Queue()
        self._warned: set[str] = set()
        self._resume_at = 0.0  # after a failed write (a full disk), saves are dropped until then
        if self.env is not None:
            self.blocks = self.env.open_db(b"blocks") if self.writable else self.env.open_db(b"blocks", create=False)
            self.uses = self.env.open_db(b"uses") if self.writable else self.env.open_db(b"uses", create=False)
            self._read_uses()
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        if self.env is not None and self.writable:
            self._writer.start()
        if self.env is not None:
            atexit.register(self.close)  # a script that ends without shutting the engine down loses no write

    # -- opening -------------------------------------------------------------------------------------
    def _open(self, path: str) -> lmdb.Environment | None:
        """The environment at `path`: read-only where the directory cannot be written; a damaged one
        moved aside and started afresh; None (no second tier) where neither works."""
        # Room for LMDB's own pages and free lists. Read-ahead stays on: a block is one run of pages,
        # which page faults one 4 KiB page at a time would read at a few tens of MB/s from disk.
        map_size = 2 * self.config.size_bytes + (64 << 20)
        try:
            os.makedirs(path, exist_ok=True)
            env = lmdb.open(path, map_size=map_size, max_dbs=2, sync=False, metasync=False)
        except (OSError, lmdb.Error) as exc:
            if not _is_damage(exc):
                return self._open_read_only(path, exc)
            return self._start_afresh(path, map_size, exc)
        if _truncated(env, path):
            env.close()
            return self._start_afresh(path, map_size, RuntimeError("its data file is shorter than its pages"))
        return env

    def _open_read_only(self, path: str, exc: Exception) -> lmdb.Environment | None:
        self.writable = False
        try:
            env = lmdb.open(path, readonly=True, lock=False, max_dbs=2)
            env.open_db(b"blocks", create=False)
        except (lmdb.Error, OSError) as again:
            logger.warning("KV offload: %s cannot be opened (%s; %s): blocks are recomputed", path, exc, again)
            return None
        logger.warning("KV offload: %s cannot be written (%s): its blocks are read, none added", path, exc)
        return env

    def _start_afresh(self, path: str, map_size: int, exc: Exception) -> lmdb.Environment | None:
        aside = f"{path.rstrip('/')}.damaged-{int(time.time())}"
        logger.warning("KV offload: the store in %s is damaged (%s): moved to %s, starting empty", path, exc, aside)
        try:
            os.replace(path, aside)
            os.makedirs(path)
            return lmdb.open(path, map_size=map_size, max_dbs=2, sync=False, metasync=False)
        except (OSError, lmdb.Error) as again:
            logger.warning("KV offload: %s cannot be started afresh (%s): blocks are recomputed", path, again)
            return None

    def _read_uses(self) -> None:
        """Every stored block's last use and size (every model's: the budget is the directory's)."""
        entries = []
        try:
            with self.env.begin(db=self.uses) as txn:
                for key, value in txn.cursor():
                    last, size = ENTRY.unpack(value)
                    entries.append((last, bytes(key), size))
        except (lmdb.Error, struct.error) as exc:
            logger.warning("KV offload: the store's index cannot be read (%s): it is read as empty", exc)
            entries = []
        with self._lock:
            for _, key, size in sorted(entries):
                self._lru[key] = size
                self._bytes += size

    # -- what the worker calls ------------------------------------------------------------------------
    def hashes(self) -> list[int]:
        """The block hashes this model (this rank) has stored."""
        with self._lock:
            return [int.from_bytes(k[len(self.prefix) :], "little") for k in self._lru if k.startswith(self.prefix)]

    def save(self, block_hash: int, payload: Any) -> None:
        """Queue a block's bytes (a buffer the caller no longer writes to); dropped, and reported as
        such, if the writer is that far behind or the store takes no writes."""
        size = memoryview(payload).nbytes
        with self._lock:
            full = (
                not self.writable
                or self.env is None
                or self._pending + size > MAX_PENDING_BYTES
                or time.monotonic() < self._resume_at
            )
            if full:
                self._counters.dropped.append(block_hash)
                return
            self._pending += size
        self._queue.put((self._key(block_hash), block_hash, payload))

    def read(self, block_hashes: list[int], into: Callable[[int, memoryview], bool]) -> list[bool]:
        """Each block's payload, checked, passed to `into(index, memoryview)` inside the read
        transaction (the view is the store's own pages; False: the caller cannot take it); whether
        each was found whole and taken."""
        if self.env is None:
            return [False] * len(block_hashes)
        found = []
        start, nbytes = time.perf_counter(), 0
        try:
            with self.env.begin(db=self.blocks, buffers=True) as txn:
                for i, block_hash in enumerate(block_hashes):
                    payload = _checked(txn.get(self._key(block_hash)))
                    ok = payload is not None and into(i, payload)
                    nbytes += payload.nbytes if ok else 0
                    found.append(ok)
        except lmdb.Error as exc:
            self._warn("read", exc)
            found += [False] * (len(block_hashes) - len(found))
        with self._lock:
            for block_hash, ok in zip(block_hashes, found):
                key = self._key(block_hash)
                if ok and key in self._lru:
                    self._lru.move_to_end(key)
                    self._touched.append(key)
                elif not ok:
                    self._forget(key, block_hash)
            self._counters.read_blocks += sum(found)
            self._counters.read_bytes += nbytes
            self._counters.read_seconds += time.perf_counter() - start
        return found

    def take_report(self) -> KVStoreReport:
        """Its reads, writes and dropped blocks since the last call."""
        with self._lock:
            report, self._counters = self._counters, KVStoreReport()
        return report

    def flush(self) -> None:
        """Wait until every queued block is written (tests; shutdown)."""
        if self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        if self.env is None:
            return
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if self.writable:
            self.env.sync(True)
        self.env.close()
        self.env = None
        _OPEN.discard(self.path)

    # -- the writer thread ----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while item is not None and not self._queue.empty() and len(batch) < 64:
                item = self._queue.get()
                batch.append(item)
            done = [entry for entry in batch if entry is not None]
            if done:
                self._write(done)
            for _ in batch:
                self._queue.task_done()
            if batch[-1] is None:
                return

    def _write(self, batch: list[tuple[bytes, int, Any]]) -> None:
        start = time.perf_counter()
        written: list[tuple[bytes, int]] = []
        evicted: list[bytes] = []
        try:
            with self.env.begin(write=True) as txn:
                self._record_uses(txn)
                for key, _, payload in batch:
                    value = _framed(payload)
                    evicted += self._make_room(txn, sum(size for _, size in written) + len(value))
                    txn.put(key, value, db=self.blocks)
                    txn.put(key, ENTRY.pack(time.time_ns(), len(value)), db=self.uses)
                    written.append((key, len(value)))
        except lmdb.Error as exc:  # a full disk or map: these blocks are not stored
            self._warn("write", exc)
            with self._lock:
                self._pending -= sum(memoryview(p).nbytes for _, _, p in batch)
                self._counters.dropped += [h for _, h, _ in batch]
                self._lru.clear()
                self._bytes = 0
            self._read_uses()  # the evictions were undone with the transaction
            self._resume_at = time.monotonic() + WRITE_RETRY_S
            return
        with self._lock:
            self._pending -= sum(memoryview(p).nbytes for _, _, p in batch)
            self._drop_evicted(evicted)
            for key, size in written:
                self._bytes += size - self._lru.pop(key, 0)
                self._lru[key] = size
            self._counters.write_blocks += len(written)
            self._counters.write_bytes += sum(size for _, size in written)
            self._counters.write_seconds += time.perf_counter() - start

    def _make_room(self, txn: lmdb.Transaction, size: int) -> list[bytes]:
        """Delete the least recently used blocks until `size` more bytes (this transaction's so far
        and the next one's) fit the budget."""
        evicted = []
        with self._lock:
            while self._lru and self._bytes + size > self.config.size_bytes:
                key, old = self._lru.popitem(last=False)
                self._bytes -= old
                evicted.append(key)
        for key in evicted:
            txn.delete(key, db=self.blocks)
            txn.delete(key, db=self.uses)
        return evicted

    def _drop_evicted(self, evicted: list[bytes]) -> None:
        for key in evicted:
            if key.startswith(self.prefix):
                self._counters.dropped.append(int.from_bytes(key[len(self.prefix) :], "little"))

    def _record_uses(self, txn: lmdb.Transaction) -> None:
        """The last use of the blocks read since the last write, kept for the order after a restart."""
        with self._lock:
            touched, self._touched = self._touched, []
            sizes = [(key, self._lru.get(key)) for key in touched]
            bad, self._bad = self._bad, []
        for key in bad:
            txn.delete(key, db=self.blocks)
            txn.delete(key, db=self.uses)
        now = time.time_ns()
        for key, size in sizes:
            if size is not None:
                txn.put(key, ENTRY.pack(now, size), db=self.uses)

    # -- helpers --------------------------------------------------------------------------------------
    def _key(self, block_hash: int) -> bytes:
        return self.prefix + block_hash.to_bytes(16, "little")

    def _forget(self, key: bytes, block_hash: int) -> None:
        """A block that could not be read whole: out of the index (the writer deletes it later)."""
        size = self._lru.pop(key, None)
        if size is not None:
            self._bytes -= size
            self._bad.append(key)
        self._counters.dropped.append(block_hash)

    def _warn(self, what: str, exc: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("KV offload: a %s failed (%s): those blocks are recomputed", what, exc)


def _framed(payload: Any) -> bytes:
    view = memoryview(payload).cast("B")
    return HEADER.pack(MAGIC, zlib.crc32(view), view.nbytes) + view.tobytes()


def _checked(value: memoryview | None) -> memoryview | None:
    """The payload of a stored value whose header and checksum hold; None otherwise."""
    if value is None or len(value) < HEADER.size:
        return None
    magic, crc, length = HEADER.unpack(value[: HEADER.size])
    payload = value[HEADER.size :]
    if magic != MAGIC or length != len(payload) or zlib.crc32(payload) != crc:
        return None
    return payload


def _is_damage(exc: Exception) -> bool:
    return isinstance(exc, (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.PageNotFoundError))


def _truncated(env: lmdb.Environment, path: str) -> bool:
    """A data file shorter than the pages its meta page says are in use (a crash mid-copy, a full
    disk): reading past its end would fault, so the store is started afresh instead."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    try:
        return os.path.getsize(os.path.join(path, "data.mdb")) < used
    except OSError:
        return True
