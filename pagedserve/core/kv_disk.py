"""The disk KV tier (--kv-offloading-disk PATH, --kv-offloading-disk-size GiB): the third tier,
below the host tier. Torch-free, like core/kv_tier.py: it keeps the index (which slot of the
rank files holds which chained prefix key) and hands the executor slot copies; every rank
writes and reads its own shard of each block in its own file (worker/disk_store.py).

The path of a block:
- the host tier evicts its oldest entry (HostTier.spill): the entry's host block is written to
  a free slot this step (the executor writes host -> disk before any device -> host copy, so
  the host block may be reused in this same step);
- a prompt whose prefix runs past the pool's and the host tier's hits into the disk tier
  prefetches those blocks into host blocks (`start_reads`); the next step promotes the ones
  the ranks read back whole (checksum and key checked there) into the host tier, and the
  request then loads them as host-tier hits, through the one copy path;
- a key is in one place at a time: a promoted (or refused) block leaves the disk index.

Survives a restart. PATH/index.jsonl starts with a header naming what wrote the files (model
path and config hash, dtypes, block size, tp/pp shape, bytes per block, format version): a
different one is refused with one message. An index record for a slot is appended only after
the ranks fsynced its bytes (they do so at most every SYNC_INTERVAL_S, and at shutdown), and every slot carries its key
and a checksum the ranks verify on reading, so a killed server's files are reused correctly
or missed (recomputed), never served stale. A disk error mid-run switches the tier off with
one log line; the tiers above go on.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.core.kv_events import KVEventLog, external_block_hash
from pagedserve.core.kv_tier import longest_chain

logger = logging.getLogger(__name__)

DISK_MEDIUM = "DISK"  # vLLM's medium string for local disk
FORMAT_VERSION = 1
INDEX_NAME = "index.jsonl"
SYNC_INTERVAL_S = 0.5  # how often the ranks fsync the step's writes (then their records are appended)


def rank_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"blocks.tp{tp_rank}.pp{pp_rank}.kv"


@dataclass(eq=False)
class DiskEntry:
    slot: int
    key: bytes
    parent_key: bytes | None
    content: bytes


@dataclass
class DiskCounters:
    stored: int = 0      # blocks written host -> disk
    loaded: int = 0      # blocks read back disk -> host (promoted to the host tier)
    refused: int = 0     # reads a rank found torn, corrupted or of another key: missed
    evicted: int = 0
    lookups: int = 0
    hits: int = 0


def free_disk_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def num_disk_slots_for(size_gib: float, bytes_per_block: int, world: int) -> int:
    """--kv-offloading-disk-size GiB over all ranks, as --kv-offloading-size reads its GiB."""
    return int(size_gib * 2**30 // (bytes_per_block * world)) if bytes_per_block else 0


def check_disk_fits(path: str, size_gib: float, num_slots: int, bytes_per_block: int, world: int,
                    free: int | None = None) -> None:
    if num_slots < 1:
        raise ValueError(f"kv_offloading_disk_size: {size_gib:g} GiB holds no KV block "
                         f"({bytes_per_block * world:,} bytes per block over {world} rank(s)); raise it")
    need = num_slots * bytes_per_block * world
    have = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.startswith("blocks.") and f.endswith(".kv"))  # reused in place
    free = free_disk_bytes(path) if free is None else free
    if need > free + have:
        raise ValueError(f"kv_offloading_disk_size: the disk KV tier needs {need / 2**30:.2f} GiB "
                         f"({num_slots:,} blocks x {bytes_per_block / 2**10:,.0f} KiB x {world} rank(s)) but "
                         f"{path} has only {(free + have) / 2**30:.2f} GiB free (with its own files); "
                         f"lower --kv-offloading-disk-size")


def measure_disk_read_bandwidth(path: str, num_bytes: int = 8 << 20) -> float:
    """Bytes/s of reading back a freshly written, fsynced file under PATH (start-up, once).
    Reads likely come from the page cache, as a recently spilled block's do."""
    probe = os.path.join(path, ".bandwidth_probe")
    data = os.urandom(num_bytes)
    try:
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        t0 = time.perf_counter()
        with open(probe, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
        return num_bytes / max(time.perf_counter() - t0, 1e-9)
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


class DiskTier:
    def __init__(self, path: str, capacity: int, block_size: int, fingerprint: dict) -> None:
        if capacity < 1:
            raise ValueError(f"kv_offloading_disk_size: the tier must hold at least one block, got {capacity}")
        self.path = path
        self.capacity = capacity
        self.block_size = block_size
        self.fingerprint = dict(fingerprint, format_version=FORMAT_VERSION, num_slots=capacity)
        self.entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # oldest first
        self.events: KVEventLog | None = None
        self.counters = DiskCounters()
        self.enabled = True
        self.read_bandwidth = 0.0
        self._free_slots: list[int] = []
        self._release: list[int] = []              # slots read this step: reusable next step
        self._writes: list[tuple[int, int, bytes]] = []   # (host block, slot, key) this step
        self._written: list[DiskEntry] = []        # their entries: indexed once durable
        self._reads: list[tuple[int, int, bytes]] = []    # (slot, host block, key) this step
        self._reading: list[tuple[DiskEntry, KVBlock]] = []
        # Records wait for the ranks' next fsync: a put names only durable bytes. A del may lag
        # (a slot rewritten before its del is recorded fails the key or checksum check).
        self._dels: list[str] = []
        self._unsynced: list[DiskEntry] = []       # written in earlier steps, not yet fsynced
        self._last_sync = time.monotonic()
        self._sync = False                         # this step's writes are fsynced
        self._index = None
        self._lock = None
        try:
            self._open_index()
        except BaseException:
            self.close()  # a refused directory stays free for the engine that may use it
            raise

    # -- the index file -------------------------------------------------------------------
    def _open_index(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        # One engine per directory: a second one would overwrite the first's slots.
        self._lock = open(os.path.join(self.path, "lock"), "a+")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ValueError(f"kv_offloading_disk: {self.path} is in use by another running engine; "
                             f"give each engine its own directory") from None
        index_path = os.path.join(self.path, INDEX_NAME)
        used: dict[int, DiskEntry] = {}
        if os.path.exists(index_path):
            with open(index_path, "rb") as f:
                lines = f.read().split(b"\n")
            try:
                header = json.loads(lines[0])
            except ValueError:
                header = None
            if header != self.fingerprint:
                differs = sorted(k for k in set(self.fingerprint) | set(header or {})
                                 if (header or {}).get(k) != self.fingerprint.get(k))
                raise ValueError(
                    f"kv_offloading_disk: {self.path} holds a KV tier written by another model or layout "
                    f"(differs in: {', '.join(differs) or 'header'}; file {({k: (header or {}).get(k) for k in differs})}, "
                    f"this engine {({k: self.fingerprint.get(k) for k in differs})}); "
                    f"use another path or remove that directory")
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break  # a torn last record (killed mid-append): what follows was never written
                slot = rec["slot"]
                if rec["op"] == "put" and 0 <= slot < self.capacity:
                    parent = rec["parent"]
                    used[slot] = DiskEntry(slot, bytes.fromhex(rec["key"]),
                                           bytes.fromhex(parent) if parent is not None else None,
                                           bytes.fromhex(rec["content"]))
                elif rec["op"] == "del":
                    used.pop(slot, None)
        for entry in used.values():  # index order = write order: oldest first
            self.entries[entry.key] = entry
        taken = {e.slot for e in self.entries.values()}
        self._free_slots = [s for s in range(self.capacity - 1, -1, -1) if s not in taken]
        # Compact: the header and the live records, replaced atomically.
        tmp = index_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(self.fingerprint) + "\n")
            for entry in self.entries.values():
                f.write(self._put_record(entry))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index_path)
        self._index = open(index_path, "a")
        if self.entries:
            logger.info("disk KV tier: %d blocks kept from the previous run in %s", len(self.entries), self.path)

    @staticmethod
    def _put_record(entry: DiskEntry) -> str:
        return json.dumps({"op": "put", "slot": entry.slot, "key": entry.key.hex(),
                           "parent": entry.parent_key.hex() if entry.parent_key is not None else None,
                           "content": entry.content.hex()}) + "\n"

    def _append(self, records: list[str]) -> None:
        if not records or self._index is None:
            return
        try:
            self._index.write("".join(records))
            self._index.flush()
            os.fsync(self._index.fileno())
        except OSError as e:
            self.disable(f"index write failed: {e}")

    # -- state ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.entries)

    def block_hashes(self) -> set[int]:
        return {external_block_hash(key) for key in self.entries}

    def announce(self) -> None:
        """KV events just turned on: the blocks kept from a previous run are stored on DISK."""
        if self.events is not None:
            for entry in self.entries.values():
                self._stored_event(entry)

    def _stored_event(self, entry: DiskEntry) -> None:
        tokens = array("q")
        tokens.frombytes(entry.content[:8 * self.block_size])
        self.events.stored(entry.key, entry.parent_key, tokens.tolist(), entry.content[8 * self.block_size:],
                           medium=DISK_MEDIUM)

    # -- the step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self._release:
            self._free_slots.extend(self._release)
            self._release = []

    def take_copies(self) -> tuple[list[tuple[int, int, bytes]], list[tuple[int, int, bytes]], bool]:
        """This step's (host block, slot, key) writes, (slot, host block, key) reads, and
        whether the ranks fsync their files after the writes (at most every SYNC_INTERVAL_S:
        an fsync per step would stall the step loop; the records wait for it)."""
        writes, self._writes = self._writes, []
        reads, self._reads = self._reads, []
        now = time.monotonic()
        self._sync = bool(self._unsynced or self._written) and now - self._last_sync >= SYNC_INTERVAL_S
        return writes, reads, self._sync

    # -- in: the host tier's evictions ------------------------------------------------------
    def spill(self, host_block: KVBlock, key: bytes, parent_key: bytes | None, content: bytes) -> bool:
        """Keep a host-tier entry the host tier evicts: its block is written this step."""
        if not self.enabled:
            return False
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        if not self._free_slots and not self._evict_oldest():
            return False
        entry = DiskEntry(self._free_slots.pop(), key, parent_key, content)
        self.entries[key] = entry
        self._writes.append((host_block.block_id, entry.slot, key))
        self._written.append(entry)
        self.counters.stored += 1
        if self.events is not None:
            self._stored_event(entry)
        return True

    # -- out: prefetch into the host tier ---------------------------------------------------
    def lookup(self, keys: list[bytes], contents: list[bytes], parent_key: bytes | None) -> list[DiskEntry]:
        if not self.enabled:
            return []
        self.counters.lookups += len(keys)
        return longest_chain(self.entries, keys, contents, parent_key)

    def start_reads(self, entries: list[DiskEntry], host_pool: BlockPool) -> int:
        """Read these entries into free host blocks this step (as many as are free); they leave
        the disk index now and reach the host tier at `finish_step`. Returns how many."""
        n = min(len(entries), host_pool.num_free_blocks)
        if n == 0:
            return 0
        hosts = host_pool.allocate(n)
        for entry, host in zip(entries[:n], hosts):
            del self.entries[entry.key]
            self._release.append(entry.slot)
            self._reads.append((entry.slot, host.block_id, entry.key))
            self._reading.append((entry, host))
            self._dels.append(json.dumps({"op": "del", "slot": entry.slot}) + "\n")
            if self.events is not None:
                self.events.removed(entry.key, medium=DISK_MEDIUM)
        self.counters.hits += n
        return n

    def finish_step(self, disk_error: str, failed_slots: list[int]) -> list[tuple[DiskEntry, KVBlock]]:
        """After the executor ran the step's copies: index the writes it made durable, and
        return the reads that came back whole (the caller moves them into the host tier; the
        host blocks of the others are the caller's to free, listed with entry None)."""
        written, self._written = self._written, []
        reading, self._reading = self._reading, []
        self._unsynced.extend(written)
        if disk_error:
            self.disable(disk_error)
        elif self._sync:
            self.flush_index()
        failed = set(failed_slots)
        good = []
        for entry, host in reading:
            if disk_error or entry.slot in failed:
                self.counters.refused += 1
                good.append((None, host))
            else:
                self.counters.loaded += 1
                good.append((entry, host))
        return good

    def flush_index(self) -> None:
        """The ranks' files are fsynced: append the records of what they now hold durably
        (slots retired first, then the slots written since the last sync), one fsync."""
        puts = [self._put_record(e) for e in self._unsynced if self.entries.get(e.key) is e]
        self._append(self._dels + puts)
        self._dels, self._unsynced = [], []
        self._last_sync = time.monotonic()
        self._sync = False

    @property
    def needs_sync(self) -> bool:
        return self.enabled and bool(self._unsynced or self._written)

    def discard(self, key: bytes) -> None:
        """The pool or the host tier holds `key` anew: the disk's copy goes."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._drop(entry)

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self._free_slots.append(entry.slot)
            self._dels.append(json.dumps({"op": "del", "slot": entry.slot}) + "\n")
        self.entries.clear()
        self._unsynced = []
        self._append(self._dels)
        self._dels = []

    def disable(self, why: str) -> None:
        """A disk error: the tier stops here (one log line); the tiers above go on."""
        if not self.enabled:
            return
        self.enabled = False
        logger.warning("disk KV tier %s: %s; the disk tier is off for the rest of this run "
                       "(the pool and the host tier go on)", self.path, why)
        for entry in list(self.entries.values()):
            if self.events is not None:
                self.events.removed(entry.key, medium=DISK_MEDIUM)
        self.entries.clear()
        self._writes, self._written, self._unsynced, self._dels = [], [], [], []
        if self._index is not None:
            try:
                self._index.close()
            except OSError:
                pass
            self._index = None

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def _evict_oldest(self) -> bool:
        if not self.entries:
            return False
        _, entry = self.entries.popitem(last=False)
        self.counters.evicted += 1
        self._drop(entry)
        return True

    def _drop(self, entry: DiskEntry) -> None:
        if self.events is not None:
            self.events.removed(entry.key, medium=DISK_MEDIUM)
        if any(w[1] == entry.slot for w in self._writes):  # written this step: not made, not indexed
            self._writes = [w for w in self._writes if w[1] != entry.slot]
            self._written = [e for e in self._written if e is not entry]
        else:
            self._dels.append(json.dumps({"op": "del", "slot": entry.slot}) + "\n")
        self._free_slots.append(entry.slot)
