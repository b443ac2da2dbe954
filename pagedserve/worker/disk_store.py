"""One rank's file of the disk KV tier (core/kv_disk.py keeps the index): `num_slots` fixed-size
slots, each a header (magic, the block's 32-byte prefix key, payload length, CRC-32 of the
payload) and the rank's shard of one KV block (every pool tensor's bytes: all layers, K and V,
a quantized pool's scales with its values). Writes are fsynced when the core asks (at most
every core/kv_disk.SYNC_INTERVAL_S), and the core appends their index records only after that; a read checks the
magic, the key it expects and the checksum, and a slot that fails any of them is a miss.
"""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import torch

MAGIC = b"PSKVBLK1"
_HEADER = struct.Struct("<8s32sQI")  # magic, key, payload bytes, crc32
HEADER_BYTES = 64


class DiskStore:
    def __init__(self, path: str, num_slots: int, tensors_bytes: list[int]) -> None:
        self.path = path
        self.num_slots = num_slots
        self.part_bytes = tensors_bytes            # per pool tensor: bytes of one block
        self.payload_bytes = sum(tensors_bytes)
        self.slot_bytes = HEADER_BYTES + self.payload_bytes
        size = num_slots * self.slot_bytes
        fresh = not os.path.exists(path) or os.path.getsize(path) != size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fresh:  # another size (or none): nothing in it can be trusted
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)

    def write(self, blocks: list[tuple[int, bytes, bytes]], sync: bool = True) -> None:
        """(slot, key, payload) each; with `sync`, everything written so far is durable on
        return. Raises OSError."""
        for slot, key, payload in blocks:
            header = _HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload)).ljust(HEADER_BYTES, b"\0")
            os.pwrite(self.fd, header + payload, slot * self.slot_bytes)
        if sync:
            os.fsync(self.fd)

    def read(self, slot: int, key: bytes) -> bytes | None:
        """The payload of `slot` if it holds `key`, whole; None otherwise. Raises OSError."""
        data = os.pread(self.fd, self.slot_bytes, slot * self.slot_bytes)
        if len(data) != self.slot_bytes:
            return None
        magic, stored_key, length, crc = _HEADER.unpack_from(data)
        payload = data[HEADER_BYTES:]
        if magic != MAGIC or stored_key != key or length != self.payload_bytes or zlib.crc32(payload) != crc:
            return None
        return payload

    def close(self) -> None:
        os.close(self.fd)


def block_payload(tensors: list[torch.Tensor], block: int) -> bytes:
    """One block's bytes over the pool tensors ([layers, 2, blocks, ...] views), in order."""
    return b"".join(t[:, :, block].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def load_payload(tensors: list[torch.Tensor], block: int, payload: bytes) -> None:
    offset = 0
    for t in tensors:
        view = t[:, :, block]
        n = view.numel() * view.element_size()
        src = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8, count=n, offset=offset).copy())
        view.copy_(src.view(view.dtype).view(view.shape))
        offset += n
