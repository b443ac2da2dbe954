"""The model forward op by op against the same forward as one native call (model/cpu/decoder.py),
in one process, on one model, alternating, at decode batch sizes.

    python benchmarks/native_forward.py --model /tmp/peers/tiny-llama --rows 1,8,32
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/native_forward.py --model /tmp/peers/tiny-llama --rows 1

Each timed call is a decode step's forward as the runner makes it: the attention metadata for
`rows` sequences of `--context` tokens, then the model (embedding, layers, final norm); the LM
head is timed apart. Both paths run the same kernels, so the difference is the per-call cost of
the per-op path (Python, ctypes argument conversion, tensor checks, allocations) and nothing else;
the two paths' hidden states are checked equal first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedserve.attention import cpu_backend
from pagedserve.model.config import read_model_config
from pagedserve.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8,32", help="running sequences, one token each")
    ap.add_argument("--context", type=int, default=150, help="tokens each sequence has seen")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=400, help="timed forwards per path per round")
    args = ap.parse_args()
    cfg = read_model_config(args.model)
    model = load_model(cfg, "float32", "cpu", max_model_len=args.context + 64)
    native = model.native_forward
    if native is None:
        raise SystemExit("the native forward does not serve this model here (see model/cpu/decoder.py)")
    block_size = 16
    blocks_per_seq = -(-(args.context + 1) // block_size)
    print(f"{args.model}: torch threads {torch.get_num_threads()}, context {args.context}, "
          f"{args.rounds} rounds of {args.calls} forwards per path; ms per forward, median of rounds (min..max)")
    for rows in map(int, args.rows.split(",")):
        pool = torch.zeros(cfg.kv_cache_shape(rows * blocks_per_seq * block_size))
        tables = [np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq) for i in range(rows)]
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))

        def forward():
            meta, positions = cpu_backend.build_metadata([(t, args.context) for t in tables], [], block_size, None,
                                                         torch.device("cpu"))
            return model(ids, torch.from_numpy(positions), pool, meta)

        times: dict[str, list[float]] = {"per-op": [], "native": [], "LM head": []}
        with torch.inference_mode():
            model.native_forward = None
            reference = forward()
            model.native_forward = native
            assert torch.equal(forward(), reference), "the native forward's hidden states differ"
            for _ in range(args.rounds):
                for name, use in (("per-op", None), ("native", native)):
                    model.native_forward = use
                    for _ in range(args.calls // 8):
                        forward()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        hidden = forward()
                    times[name].append((time.perf_counter() - start) / args.calls * 1e3)
                start = time.perf_counter()
                for _ in range(args.calls):
                    model.compute_logits(hidden)
                times["LM head"].append((time.perf_counter() - start) / args.calls * 1e3)
            model.native_forward = native
        shown = ", ".join(f"{name} {statistics.median(t):.3f} ({min(t):.3f}..{max(t):.3f})"
                          for name, t in times.items())
        ratio = statistics.median(a / b for a, b in zip(times["per-op"], times["native"]))
        print(f"rows {rows:>3}: {shown}; per-op / native {ratio:.2f}x (paired by round)")


if __name__ == "__main__":
    main()
