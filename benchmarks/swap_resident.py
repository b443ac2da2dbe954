"""Resident host memory of the swap pool under a swap-heavy load: the host pool handing out the
most recently freed block first (what the engine does) vs the oldest-freed first (the order it
had before), same load, one run.

The pool is the default --swap-space (4 GiB of address space, mapped lazily); what counts is how
much of it becomes resident. Measured with mincore(2) over the pool's own buffer (pages in RAM),
plus the process's VmRSS growth.

    OMP_NUM_THREADS=1 python benchmarks/swap_resident.py [--requests 1000]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import random
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
PAGE = mmap.PAGESIZE


def resident_bytes(tensor) -> int:
    """Bytes of `tensor`'s buffer that are in RAM (mincore, page granularity)."""
    start = tensor.data_ptr() // PAGE * PAGE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = (end - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * PAGE


def rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def run(model: str, recent_first: bool, num_requests: int) -> dict:
    from pagedserve.config import EngineConfig
    from pagedserve.engine import Engine
    from pagedserve.sampling import SamplingParams

    # 24 device blocks for 6 sequences that grow to 6 blocks each: preempted by swap all along.
    engine = Engine(EngineConfig(model=model, max_num_seqs=6, num_kv_blocks=24, max_model_len=128,
                                 enable_prefix_caching=False, preemption_mode="swap", swap_space="4GiB"))
    core = engine.engine_core
    host_pool = core.scheduler.kv.host_pool
    host_pool.reuse_recent_first = recent_first
    host = core.executor.host_cache
    rss0 = rss_bytes()
    rng = random.Random(1)
    most = step = arrived = 0
    while arrived < num_requests or engine.has_unfinished_requests():
        if arrived < num_requests and step % 4 == 0:
            engine.add_request(f"r{arrived}", [rng.randrange(16, 384) for _ in range(12)],
                               SamplingParams(max_tokens=rng.randrange(40, 100), ignore_eos=True))
            arrived += 1
        engine.step()
        step += 1
        most = max(most, host_pool.num_used_blocks)
    out = {"host_blocks": host_pool.num_blocks, "bytes_per_block": core.pool.bytes_per_block, "most_at_once": most,
           "swapped_out": core.scheduler.total_blocks_swapped["out"], "resident": resident_bytes(host),
           "rss_growth": rss_bytes() - rss0}
    engine.engine_core.shutdown()
    del engine, core, host_pool, host
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    from checkpoints import make_checkpoint

    model = make_checkpoint(Path(tempfile.mkdtemp()), "llama", hidden=256, layers=4, heads=4, kv_heads=4, inter=256)
    rows = [("recently freed first (now)", run(str(model), True, args.requests)),
            ("oldest freed first (before)", run(str(model), False, args.requests))]
    r = rows[0][1]
    print(f"{args.requests} requests; host pool {r['host_blocks']:,} blocks x {r['bytes_per_block'] // 1024} KiB "
          f"= {r['host_blocks'] * r['bytes_per_block'] / 2**30:.2f} GiB of address space")
    print(f"{'host pool order':<30} {'swapped out':>11} {'most at once':>12} {'pool resident':>14} {'RSS growth':>11}")
    for name, r in rows:
        print(f"{name:<30} {r['swapped_out']:>11,} {r['most_at_once']:>12} {r['resident'] / 2**20:>10.1f} MiB "
              f"{r['rss_growth'] / 2**20:>7.1f} MiB")
    print(f"resident ratio (before / now): {rows[1][1]['resident'] / max(rows[0][1]['resident'], 1):.1f}x")


if __name__ == "__main__":
    main()
