"""How long one full garbage collection stalls a process that holds a loaded engine, before and
after freezing its start-up heap (what `pagedserve serve`'s processes do: utils.freeze_startup_heap).

    python benchmarks/gc_pause.py [--model /tmp/peers/tiny-llama] [--repeats 3]

Prints the tracked objects, each full collection's wall time unfrozen, then frozen, side by side.
"""
from __future__ import annotations

import argparse
import gc
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from pagedserve import LLM

    llm = LLM(model=args.model, max_model_len=512, kv_cache_memory=1 << 28)  # held: its heap is the point

    def full_ms() -> float:
        t = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - t) * 1e3

    tracked = len(gc.get_objects())
    unfrozen = [full_ms() for _ in range(args.repeats)]
    gc.freeze()
    frozen = [full_ms() for _ in range(args.repeats)]
    print(f"tracked objects {tracked}; load average {os.getloadavg()[0]:.2f}")
    print("full collection, ms:  unfrozen " + " ".join(f"{v:.1f}" for v in unfrozen)
          + "   frozen " + " ".join(f"{v:.2f}" for v in frozen))
    del llm


if __name__ == "__main__":
    main()
