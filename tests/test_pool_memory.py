"""The KV pool's host memory (worker.model_runner.allocate_zeroed): zeros, mapped lazily, and
not advised for transparent huge pages, whose first writes stall for compaction where the
kernel's THP defrag is `madvise` (numpy's calloc path advised them: a burst's prefill into a
fresh 4 GiB pool ran 1.5x slower, benchmarks/README.md)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from pagedserve.worker.model_runner import allocate_zeroed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def mappings_over(lo: int, hi: int) -> list[dict[str, str]]:
    """The /proc/self/smaps entries that overlap [lo, hi): their fields, VmFlags included."""
    entries, entry = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {"range": head} if start < hi and lo < end else None
                if entry is not None:
                    entries.append(entry)
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert entries, f"no mapping holds {lo:#x}"
    return entries


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pool_is_zeros_mapped_lazily_without_huge_page_advice(dtype):
    shape = (2, 2, 64 * 1024, 1, 64)  # 16 MiB of float32: well past any malloc threshold
    before = rss_bytes()
    pool = allocate_zeroed(shape, dtype, torch.device("cpu"))
    nbytes = pool.numel() * pool.element_size()
    assert rss_bytes() - before < nbytes // 4                                   # nothing touched yet
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    entries = mappings_over(pool.data_ptr(), pool.data_ptr() + nbytes)
    assert not any("hg" in e["VmFlags"].split() for e in entries), entries        # no MADV_HUGEPAGE
    assert not pool.any()
    pool[1, 0, 5] = 3
    assert int(pool.sum()) == 3 * 64


def test_a_fork_succeeds_beside_pools_larger_than_memory():
    """Pools mapped side by side merge into one mapping; a fork() must not be refused for it (the
    kernel's overcommit guess checks each accounted mapping against RAM + swap)."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    each = (info["MemTotal"] + info.get("SwapTotal", 0)) // 2
    pools = [allocate_zeroed((each // 4,), torch.float32, torch.device("cpu")) for _ in range(3)]
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not pools[0][:16].any()
