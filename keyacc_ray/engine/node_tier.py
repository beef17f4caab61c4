"""The node's shared KV tier: cached blocks in host memory that every engine on the machine can
read, whichever pool (GPU or CPU, any NUMA node) computed them. No torch, no Ray.

A block is a file named by its key (blocks.chain_hashes: the hash of its whole prefix) under a
directory of the engines' KV format (model, layer and head sizes, dtype, block size), on a tmpfs
(/dev/shm where it has room): memory, not disk. A writer creates the file (the first of two
writers wins) and writes the block in one call; a reader takes a file shorter than a block as a
miss (being written, or its writer died: rewritten a minute later), and one that opens a file
keeps its bytes even if another process evicts it a moment later. The budget is kept by
whoever writes: past it, the least recently used files (their modification time, which a hit
refreshes) are removed down to KEEP of it. An engine's writes go through a thread of the tier's
own, off the engine's step (the engine copies the blocks out of its pool; the files are written
behind it). Nothing here is an error to an engine: a block that cannot be read or written is a
miss, and the engine computes it. Its cost is system calls: a few per block written or read
(`python scripts/bench_node_tier.py`).

Engines write every full block they computed into it when a sequence finishes or leaves with a
hand-off (LLMEngine), and look in it, after their own device and host tiers, for the head of a
new prompt (tiers.LowerTiers): a prompt computed on the GPU pool and continued, or asked again,
on a CPU pool loads its head from here instead of computing it, and a hand-off leaves out of its
package the blocks already here.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time

import numpy as np

log = logging.getLogger(__name__)

SHM = "/dev/shm"
KEEP = 0.75  # after an eviction pass, the share of the budget left in use
QUEUE_BYTES = 256 << 20  # blocks waiting for the writer thread, at most
STALE_WRITE_NS = 60 * 10**9  # a short file this old is a dead writer's
STALE_FORMAT_S = 86_400.0  # another format's directory nobody wrote into for this long is removed


def default_root(budget_bytes: int) -> str:
    """/dev/shm/keyacc-kv where that tmpfs has room for the budget, else the temp dir (a
    container's /dev/shm is often 64 MB)."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        st = os.statvfs(SHM)
        if st.f_bavail * st.f_frsize >= budget_bytes:
            return os.path.join(SHM, "keyacc-kv")
        log.warning("%s has %.1f GiB free, less than the node KV tier's %.1f GiB: using the temp dir",
                    SHM, st.f_bavail * st.f_frsize / 2**30, budget_bytes / 2**30)
    return os.path.join(tempfile.gettempdir(), "keyacc-kv")


def namespace(model: str, *format_parts) -> str:
    """A directory name for one model's KV format: engines share blocks only where every part
    agrees, and the model's weight files (a local directory's: names, sizes, modification times)
    are the same ones: a model written again at the same path starts a new directory."""
    stamp: list = [model]
    where = model if os.path.isdir(model) else _hub_snapshot(model)
    if where:
        for name in sorted(os.listdir(where)):
            if name.endswith((".safetensors", ".bin", ".pt", ".json")):
                st = os.stat(os.path.join(where, name))
                stamp.append((where, name, st.st_size, st.st_mtime_ns))
    return hashlib.blake2b(repr((stamp, format_parts)).encode(), digest_size=8).hexdigest()


def _sweep_stale_formats(root: str, keep: str) -> None:
    """Remove the directories of formats nobody wrote into for STALE_FORMAT_S (a model since
    written again, or no longer served): each is bounded, but they would add up in memory."""
    now = time.time()
    try:
        with os.scandir(root) as it:
            old = [e.path for e in it if e.name != keep and e.is_dir(follow_symlinks=False)
                   and now - e.stat().st_mtime > STALE_FORMAT_S]
    except OSError:
        return
    for path in old:
        shutil.rmtree(path, ignore_errors=True)


def _hub_snapshot(model_id: str) -> str | None:
    """The local snapshot directory of a hub id (its path names the revision), if cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id, or no hub library
        return None
    return os.path.dirname(path) if isinstance(path, str) else None


class NodeTier:
    """One KV format's blocks on this node, shared by every process that opens the same directory.
    `block_bytes`: one block's bytes (every layer's K, then every layer's V); `budget_bytes`: the
    most the directory holds (each writer keeps to it)."""

    def __init__(self, root: str, space: str, block_bytes: int, budget_bytes: int):
        self.dir = os.path.join(root, space)
        _sweep_stale_formats(root, keep=space)
        os.makedirs(self.dir, exist_ok=True)
        self.block_bytes = block_bytes
        self.name = "node"  # (as the engine's own tiers: name, num_slots, evictions, len())
        self.num_slots = max(1, budget_bytes // block_bytes)
        self.evictions = 0  # files this process removed to keep the budget
        self.write_errors = 0
        # put_async's queue (at most QUEUE_BYTES of blocks) and the keys in it; the writer thread
        self._queue: queue.Queue = queue.Queue(maxsize=max(16, QUEUE_BYTES // block_bytes))
        self._pending: set[bytes] = set()
        # keys this process wrote or read here lately (at most the budget's count): found without
        # a system call (an engine asks for every block of a sequence when it finishes; one that
        # another process evicted since is a miss when read, and not written again meanwhile)
        self._known: dict[bytes, None] = {}
        self._known_lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self.dropped = 0  # blocks not queued: the writer was behind
        self._count = self._scan_and_evict()  # (files left by earlier processes count too)

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex())

    def __contains__(self, key: bytes) -> bool:
        return key in self._pending or key in self._known or os.path.exists(self._path(key))

    def _seen(self, key: bytes) -> None:
        with self._known_lock:
            known = self._known
            known.pop(key, None)
            known[key] = None
            while len(known) > self.num_slots:
                del known[next(iter(known))]

    def __len__(self) -> int:
        return self._count

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes (a uint8 array of block_bytes), or None where it is not here."""
        fd = self.open(key)
        return self.read(fd) if fd is not None else None

    def open(self, key: bytes) -> int | None:
        """An open descriptor of the block's file, or None where it is not here (or is not a
        whole block). Its bytes stay readable through it even if another process removes the
        file meanwhile. A hit makes the block the most recently used."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != self.block_bytes:
                os.close(fd)
                return None
            os.utime(path)
        except OSError:
            pass  # (removed meanwhile: still readable through fd)
        self._seen(key)
        return fd

    @staticmethod
    def read(fd: int) -> np.ndarray:
        """The bytes behind `open`'s descriptor; the descriptor is closed."""
        try:
            size = os.fstat(fd).st_size
            out = bytearray(size)
            view, at = memoryview(out), 0
            while at < size:  # (pread may return less than asked)
                n = os.preadv(fd, [view[at:]], at)
                if n <= 0:
                    break
                at += n
        finally:
            os.close(fd)
        return np.frombuffer(out, dtype=np.uint8)

    def put_async(self, key: bytes, row: np.ndarray) -> bool:
        """Queue `row` (block_bytes of uint8, not to be changed after) to be kept under `key` by
        this tier's writer thread, off the engine's step; False where the queue is full (the
        writer behind: the block is not shared)."""
        if key in self._pending:
            return True
        self._pending.add(key)
        try:
            self._queue.put_nowait((key, row))
        except queue.Full:
            self._pending.discard(key)
            self.dropped += 1
            return False
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="keyacc-node-tier", daemon=True)
            self._writer.start()
        return True

    def flush(self) -> None:
        """Until every queued block is written."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            key, row = self._queue.get()
            try:
                self.put(key, row)
            except Exception:  # noqa: BLE001 - a cache: a block not written is a miss, never a dead writer
                log.exception("node KV tier: writing a block failed")
            finally:
                self._pending.discard(key)
                self._queue.task_done()

    def put(self, key: bytes, row: np.ndarray) -> bool:
        """Keep `row` (block_bytes of uint8) under `key` now; False where it could not be written
        (a full tmpfs): the block is then simply not shared. The file is created under its own
        name and written in one call: a reader that finds it shorter than a block (being written)
        takes it as a miss, and once it has a block's size every byte is there (a file grows as
        its bytes are copied in). Three system calls a block: the tier's cost is mostly those."""
        assert row.nbytes == self.block_bytes, (row.nbytes, self.block_bytes)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return self._existing(path, key, row)
        except OSError as e:
            return self._write_failed(e)
        try:
            view = memoryview(np.ascontiguousarray(row)).cast("B")
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            return self._write_failed(e)
        os.close(fd)
        self._seen(key)
        self._count += 1
        # the directory is listed (a stat a file) once this process's count passes the budget:
        # its count is what it saw at its last listing plus its own writes since, so with other
        # processes writing too the directory holds at most (1 - KEEP) of the budget more per
        # writing process
        if self._count > self.num_slots:
            self._count = self._scan_and_evict()
        return True

    def _existing(self, path: str, key: bytes, row: np.ndarray) -> bool:
        """Another writer's file is there: refreshed if whole; if a writer died halfway through it
        (short and old), written again."""
        try:
            st = os.stat(path)
            if st.st_size == self.block_bytes:
                os.utime(path)
                self._seen(key)
                return True
            if time.time_ns() - st.st_mtime_ns > STALE_WRITE_NS:
                os.unlink(path)
                return self.put(key, row)
        except OSError:
            pass
        return False

    def _write_failed(self, e: OSError) -> bool:
        self.write_errors += 1
        if self.write_errors == 1:
            log.warning("node KV tier: a block could not be written under %s (%s); blocks that cannot "
                        "be written are not shared", self.dir, e)
        return False

    def _scan_and_evict(self) -> int:
        """List the directory; past the budget, remove the least recently used blocks down to
        KEEP of it. Returns the blocks left."""
        entries = []
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    try:
                        entries.append((e.stat().st_mtime_ns, e.path))
                    except OSError:
                        pass  # (removed meanwhile)
        except OSError:
            return 0
        if len(entries) <= self.num_slots:
            return len(entries)
        entries.sort()
        drop = len(entries) - int(self.num_slots * KEEP)
        for _, path in entries[:drop]:
            try:
                os.unlink(path)
                self.evictions += 1
            except OSError:
                pass
            try:
                key = bytes.fromhex(os.path.basename(path))
            except ValueError:
                continue  # (not a block's name)
            with self._known_lock:
                self._known.pop(key, None)
        return len(entries) - drop

    def clear(self) -> None:
        """Every block of this format gone, for every process (reset_prefix_cache)."""
        self.flush()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)
        self._count = 0
        with self._known_lock:
            self._known.clear()
