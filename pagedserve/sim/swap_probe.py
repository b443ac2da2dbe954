"""A short host-copy probe: what a CPU engine's swap costs, when its calibration trace swapped nothing.

The engine swaps by copying whole blocks between its pool and the host pool
(worker/model_runner.py `copy_blocks`: one `index_select` over the block axis of the pool's
[layers, 2, blocks, block_size, ...] view, then one `index_copy_`, per tensor). This probe does
exactly that on tensors of the same layout and dtype, for 1 to 64 blocks, and fits
``t = per_step_s + bytes / bandwidth`` by least squares: the fixed part (building the index
tensors, launching the copies) is what a memcpy benchmark misses, and it is most of a small
swap. A few tenths of a second; needs torch (calibrate runs beside the engine anyway).
"""
from __future__ import annotations

import statistics
import time


def probe_swap_cost(bytes_per_token: int, num_layers: int, block_size: int = 16, dtype: str = "float32",
                    block_counts=(1, 4, 16, 64), repeats: int = 5) -> tuple[float, float, str]:
    """(bytes/s, seconds per swapping step, how) of the engine's block copy on this machine.

    `bytes_per_token`: one rank's KV bytes per token (all layers, K and V)."""
    import numpy as np
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    torch_dtype = dtypes.get(dtype, torch.float32)
    elem = torch.empty((), dtype=torch_dtype).element_size()
    per_layer_kv = max(1, bytes_per_token // max(num_layers * 2 * elem, 1))  # values per token, layer, K or V
    num_blocks = max(block_counts) * 2
    shape = (num_layers, 2, num_blocks, block_size, per_layer_kv)
    src = torch.ones(shape, dtype=torch_dtype)
    dst = torch.zeros(shape, dtype=torch_dtype)
    bytes_per_block = num_layers * 2 * block_size * per_layer_kv * elem
    rows = []
    for n in block_counts:
        src_ids = list(range(0, 2 * n, 2))  # scattered, as a real block table is
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            a = torch.tensor(src_ids)
            b = torch.tensor(src_ids)
            moved = src.index_select(2, a)
            dst.index_copy_(2, b, moved)
            times.append(time.perf_counter() - t0)
        rows.append((n * bytes_per_block, statistics.median(times[1:])))
    x = np.asarray([(1.0, float(nb)) for nb, _ in rows])
    y = np.asarray([t for _, t in rows])
    from pagedserve.sim.cost_model import _nnls

    c = _nnls(x / y[:, None], np.ones(len(y)))  # relative: small swaps weigh as much as big ones
    per_step, per_byte = float(c[0]), float(c[1])
    if per_byte <= 0:  # noise: take the largest copy's rate
        per_byte = rows[-1][1] / rows[-1][0]
    how = (f"the engine's block copy probed here ({len(block_counts)} sizes, {block_counts[0]}-{block_counts[-1]} "
           f"blocks of {bytes_per_block:,} bytes): {per_step * 1e6:.0f} us per swapping step + "
           f"{1 / per_byte / 1e9:.2f} GB/s")
    return 1.0 / per_byte, per_step, how
