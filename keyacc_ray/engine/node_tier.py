"""The node's shared KV tier: cached blocks in host memory that every engine on the machine can
read, whichever pool (GPU or CPU, any NUMA node) computed them. No torch, no Ray.

A block is a file named by its key (blocks.chain_hashes: the hash of its whole prefix) under a
directory of the engines' KV format (model, layer and head sizes, dtype, block size), on a tmpfs
(/dev/shm where it has room): memory, not disk. A writer writes a file under a name of its own
and renames it into place, so that a reader finds a whole block or none; a reader that opens a
file keeps its bytes even if another process evicts it a moment later. The budget is kept by
whoever writes: past it, the least recently used files (their modification time, which a hit
refreshes) are removed down to 90% of it. Nothing here is an error to an engine: a block that
cannot be read or written is a miss, and the engine computes it.

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
import shutil
import tempfile
import time

import numpy as np

log = logging.getLogger(__name__)

SHM = "/dev/shm"
KEEP = 0.9  # after an eviction pass, the share of the budget left in use
STALE_TMP_NS = 60 * 10**9  # a half-written file this old is a dead writer's
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
        self.slots = max(1, budget_bytes // block_bytes)
        self.name = "node"
        self.num_slots = self.slots
        self._tag = f".{os.getpid()}.tmp"
        self._since_scan = 0
        self._count = self._scan_and_evict()  # (files left by earlier processes count too)
        self.evictions = 0  # files this process removed to keep the budget
        self.write_errors = 0

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex())

    def __contains__(self, key: bytes) -> bool:
        return os.path.exists(self._path(key))

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

    def put(self, key: bytes, row: np.ndarray) -> bool:
        """Keep `row` (block_bytes of uint8) under `key`; False where it could not be written (a full
        tmpfs): the block is then simply not shared."""
        path = self._path(key)
        if os.path.exists(path):
            try:
                os.utime(path)
                return True
            except OSError:
                pass  # (evicted meanwhile: written again)
        assert row.nbytes == self.block_bytes, (row.nbytes, self.block_bytes)
        tmp = path + self._tag
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(np.ascontiguousarray(row)).cast("B"))
            os.replace(tmp, path)
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("node KV tier: a block could not be written under %s (%s); blocks that cannot "
                            "be written are not shared", self.dir, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self._count += 1
        self._since_scan += 1
        # other processes write too: this process's count is a lower bound, so the directory is
        # listed again once it has written a tenth of the budget since it last looked
        if self._count > self.slots or self._since_scan * 10 >= self.slots:
            self._count = self._scan_and_evict()
        return True

    def _scan_and_evict(self) -> int:
        """List the directory; past the budget, remove the least recently used blocks down to
        KEEP of it. Returns the blocks left."""
        self._since_scan = 0
        entries = []
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    try:
                        mtime = e.stat().st_mtime_ns
                        if not e.name.endswith(".tmp"):
                            entries.append((mtime, e.path))
                        elif time.time_ns() - mtime > STALE_TMP_NS:  # a writer that died halfway
                            os.unlink(e.path)
                    except OSError:
                        pass  # (removed meanwhile)
        except OSError:
            return 0
        if len(entries) <= self.slots:
            return len(entries)
        entries.sort()
        drop = len(entries) - int(self.slots * KEEP)
        for _, path in entries[:drop]:
            try:
                os.unlink(path)
                self.evictions += 1
            except OSError:
                pass
        return len(entries) - drop

    def clear(self) -> None:
        """Every block of this format gone, for every process (reset_prefix_cache)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)
        self._count = 0
