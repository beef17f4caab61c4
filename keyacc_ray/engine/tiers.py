"""KV tiers below the device's block pool: host memory, then disk. No torch: which cached block
lives where, and the ordered list of copies a step must make (engine/kv_store.py makes them).

A cached block (blocks.py: full, keyed by the hash of its whole prefix) whose device memory is
taken for new tokens goes down to the host tier instead of being dropped; a host block pushed out
goes down to the disk tier; the disk tier's least recently used block is dropped. Beside them,
the node's shared tier (node_tier.py), which every engine on the machine reads and writes. A new
sequence whose prefix continues, past the blocks cached on the device, with blocks held in a
lower tier loads them into new device blocks when that is cheaper than computing them again
(their bytes over the tier's measured bandwidth against the tokens over the engine's measured
prefill rate), else computes them. A tier that is full degrades to recompute, never to an error.

Copies are planned while the scheduler allocates and run, in plan order, before the step's
forward: a block pushed out of a tier slot is copied away before the slot is written, a block
evicted from the device is copied out before a load or the forward overwrites it. Blocks planned
for a load this step are pinned in their tier until the copies ran.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from keyacc_ray.engine.scheduler import PrefillRate

DEVICE = "device"
# A tier the cost model last found slower than recomputing is loaded from once more after this
# long, to measure it again: its bandwidth only moves on loads, so one slow reading (a first read,
# a busy moment) would otherwise keep the engine recomputing what that tier holds for good.
REPROBE_S = 10.0


@dataclass(frozen=True, slots=True)
class Move:
    """Copy one block: (src kind, src index) -> (dst kind, dst index); kinds "device", "host", "disk"."""
    src: str
    src_index: int
    dst: str
    dst_index: int


def batches(moves: list[Move]) -> list[list[Move]]:
    """The step's copies grouped into as few batches of one (src kind, dst kind) as their order
    allows, in an order that gives what running them one by one gives: a copy waits for the
    copies before it that write its source, or read or write its destination (a block pushed out
    of a slot is copied away before the slot is written); copies with nothing between them run
    in one batch (each batch reads all its sources, then writes all its destinations). Without
    this, a step that evicts n blocks down a chain ran 2n batches of one block."""
    wrote: dict[tuple[str, int], int] = {}  # location -> the last phase that wrote it
    read: dict[tuple[str, int], int] = {}  # location -> the last phase that read it
    phased = []
    for i, m in enumerate(moves):
        src, dst = (m.src, m.src_index), (m.dst, m.dst_index)
        phase = max(wrote.get(src, -1), read.get(dst, -1), wrote.get(dst, -1)) + 1
        wrote[dst] = phase
        read[src] = max(read.get(src, -1), phase)
        phased.append((phase, m.src, m.dst, i, m))
    phased.sort(key=lambda x: x[:4])
    out: list[list[Move]] = []
    last = None
    for phase, src, dst, _, m in phased:
        if (phase, src, dst) != last:
            out.append([])
            last = (phase, src, dst)
        out[-1].append(m)
    return out


class TierIndex:
    """The keys one tier holds: a slot each, least recently used first."""

    def __init__(self, name: str, num_slots: int):
        self.name = name
        self.num_slots = num_slots
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.pinned: set[bytes] = set()
        self.evictions = 0  # blocks pushed out (down a tier, or dropped)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def touch(self, key: bytes) -> None:
        self.slot_of.move_to_end(key)

    def place(self, key: bytes) -> tuple[int, bytes | None, int] | None:
        """A slot for `key`: (slot, the key pushed out of it or None, its slot); None if every slot
        is pinned."""
        if self._free:
            slot = self._free.pop()
            self.slot_of[key] = slot
            return slot, None, -1
        for old in self.slot_of:  # least recently used first
            if old not in self.pinned:
                slot = self.slot_of.pop(old)
                self.slot_of[key] = slot
                self.evictions += 1
                return slot, old, slot
        return None


class LowerTiers:
    """The host and disk tiers of one engine, its copy plan for the step, and the load-vs-recompute
    cost model. `block_bytes`: one block's K and V over every layer."""

    def __init__(self, host_slots: int, disk_slots: int, block_bytes: int, block_size: int, node=None,
                 always_load: bool = False):
        """`node`: the node's shared tier (node_tier.NodeTier), if any: searched after the host tier,
        before the disk; it is not in this engine's chain of evictions (other engines' writes push
        its blocks out), it gets every full block the engine computed (`publish`).
        `always_load`: what a lower tier holds is loaded, whatever the cost model says
        (EngineConfig.kv_tier_load "always")."""
        self.always_load = always_load
        self.tiers = [t for t in (TierIndex("host", host_slots) if host_slots else None,
                                  TierIndex("disk", disk_slots) if disk_slots else None) if t is not None]
        self.node = node
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.moves: list[Move] = []
        # the node tier's side of this step's moves: blocks to load, as descriptors opened when
        # found (so that another process's eviction cannot take their bytes before the copy), and
        # the keys to write
        self.node_reads: list[int | None] = []
        self.node_writes: list[bytes] = []
        names = [t.name for t in self.tiers] + (["node"] if node is not None else [])
        # cost model: bytes/s per tier (copies into the device, measured), prefill tokens/s (the
        # engine's steps of 64 prompt tokens or more, measured); unknown (None, 0) until measured,
        # and then loading is assumed cheaper
        self.bandwidth: dict[str, float | None] = {n: None for n in names}
        self.measured_at: dict[str, float] = {}  # when each tier's bandwidth was last measured (monotonic)
        self.reprobes = {n: 0 for n in names}  # loads made to measure a tier judged slower again
        self._probing: set[str] = set()  # tiers whose next measurement replaces their estimate
        self.prefill = PrefillRate(min_tokens=64)
        # counters: tokens found per tier, blocks loaded / stored per tier, blocks recomputed by choice
        self.hits = {n: 0 for n in names}
        self.loaded = {n: 0 for n in names}
        self.stored = {n: 0 for n in names}
        self.recomputed = 0
        self.events = None  # kv_events.KVEvents: what the router is told of the keys held here

    def reset(self) -> None:
        """Every tier emptied, the node's for every engine too (nothing planned is lost: called
        between steps)."""
        self.tiers = [TierIndex(t.name, t.num_slots) for t in self.tiers]
        if self.events is not None:
            self.events.reset()
        if self.node is not None:
            self.node.clear()

    def all_tiers(self) -> list:
        """Every tier, in the order a prompt's head is looked up: host, node, disk."""
        return [t for t in self.tiers if t.name == "host"] + ([self.node] if self.node is not None else []) + \
            [t for t in self.tiers if t.name == "disk"]

    def holding(self, key: bytes) -> str:
        """The tier of this engine's own (host, disk) that holds `key`, or ""."""
        for t in self.tiers:
            if key in t:
                return t.name
        return ""

    def tier(self, name: str) -> TierIndex:
        return next(t for t in self.tiers if t.name == name)

    # ---- going down ------------------------------------------------------------------------
    def evicted(self, key: bytes, block: int) -> None:
        """The device block `block`, cached under `key`, is taken for new tokens: keep it a tier down
        (in the node's tier where this engine has no tier of its own)."""
        if self.tiers:
            self._store(0, key, DEVICE, block)
        else:
            self.publish([key], [block])

    def publish(self, keys: list[bytes], blocks: list[int]) -> None:
        """Plan copies of the device blocks `blocks` (cached under `keys`) into the node's tier, for
        the other engines on the node, where it does not hold them yet."""
        node = self.node
        if node is None:
            return
        planned = set(self.node_writes)
        for key, b in zip(keys, blocks):
            if key not in planned and key not in node:
                self.moves.append(Move(DEVICE, b, "node", len(self.node_writes)))
                self.node_writes.append(key)
                planned.add(key)
                self.stored["node"] += 1

    def _store(self, level: int, key: bytes, src: str, src_index: int) -> None:
        t = self.tiers[level]
        if key in t:  # (still there from before it was loaded: nothing to copy)
            t.touch(key)
            return
        got = t.place(key)
        if got is None:
            if self.events is not None:
                self.events.moved(key)
            return  # every slot pinned this step: dropped
        slot, old, old_slot = got
        if old is not None and self.events is not None:
            self.events.moved(old)
        if old is not None and level + 1 < len(self.tiers):
            self._store(level + 1, old, t.name, old_slot)  # copied down before the slot is written
        self.moves.append(Move(src, src_index, t.name, slot))
        self.stored[t.name] += 1

    # ---- coming back -----------------------------------------------------------------------
    def _worth_loading(self, tier: str, probing: set) -> bool:
        """Whether to load blocks of `tier` (a tier in `probing` is being measured again in this
        find(): all its blocks there are loaded, a batch that measures its bandwidth)."""
        bw, rate = self.bandwidth[tier], self.prefill.tokens_per_s
        if self.always_load or tier in probing or not bw or not rate:
            return True
        if self.block_bytes / bw < self.block_size / rate:
            return True
        now = time.monotonic()
        if now - self.measured_at.get(tier, now) < REPROBE_S:
            return False
        self.measured_at[tier] = now  # (one probe per REPROBE_S, whether or not its copy runs)
        self.reprobes[tier] += 1
        probing.add(tier)
        self._probing.add(tier)
        return True

    def find(self, keys: list[bytes]) -> list[tuple[str, bytes]]:
        """The leading `keys` held in a lower tier and worth loading: (tier, key) each, pinned for
        this step (so that nothing planned after it pushes them out before the copies ran); a
        block of the node's tier is opened now (its bytes are read by the copy)."""
        found, order, probing = [], self.all_tiers(), set()
        if not self.moves:  # (opened for admissions that did not happen: no copy needs them)
            self.close_node_reads()
        for i, key in enumerate(keys):
            t = next((t for t in order if key in t), None)
            if t is None:
                break
            if not self._worth_loading(t.name, probing):  # this one and the rest held below: computed again
                self.recomputed += sum(1 for k in keys[i:] if any(k in t for t in order))
                break
            if t is self.node:
                fd = t.open(key)
                if fd is None:  # (gone since: another engine's write pushed it out)
                    break
                self.node_reads.append(fd)
                found.append(("node", len(self.node_reads) - 1))
                continue
            t.pinned.add(key)
            t.touch(key)
            found.append((t.name, key))
        return found

    def load(self, found: list[tuple[str, bytes]], blocks: list[int]) -> None:
        """Plan the copies of `found` (from find()) into the device blocks `blocks`."""
        for (name, key), b in zip(found, blocks):
            src = key if name == "node" else self.tier(name).slot_of[key]
            self.moves.append(Move(name, src, DEVICE, b))
            self.hits[name] += self.block_size
            self.loaded[name] += 1

    def take_moves(self) -> list[Move]:
        """This step's copies, in the order they must run; pins released."""
        moves, self.moves = self.moves, []
        for t in self.tiers:
            t.pinned.clear()
        return moves

    def take_node_side(self) -> tuple[list, list[bytes]]:
        """The node tier's descriptors opened for this step's loads, and the keys its writes go
        under (a Move's index into them); emptied. The taker reads and closes the descriptors
        (close_node_reads: those it did not read)."""
        side = self.node_reads, self.node_writes
        self.node_reads, self.node_writes = [], []
        return side

    def close_node_reads(self, reads: list | None = None) -> None:
        """Close the descriptors not read (None: read) of `reads` (by default, those waiting here)."""
        reads = self.node_reads if reads is None else reads
        for i, fd in enumerate(reads):
            if fd is not None:
                os.close(fd)
                reads[i] = None
        if reads is self.node_reads:
            self.node_reads = []

    def measured(self, tier: str, nbytes: int, seconds: float) -> None:
        """A copy of `nbytes` from `tier` into the device took `seconds`."""
        if seconds > 0 and nbytes > 0:
            bw = nbytes / seconds
            old = self.bandwidth.get(tier)
            if tier in self._probing:  # measured again after a slow reading: this reading stands
                self._probing.discard(tier)
                old = None
            self.bandwidth[tier] = bw if old is None else 0.8 * old + 0.2 * bw
            self.measured_at[tier] = time.monotonic()

