"""Decode steps of one engine with two builds of the CPU GEMM (model/cpu/gemm.cpp) taking turns,
in one process: an A/B of a GEMM change end to end that a shared machine cannot spoil the way
it spoils two separate runs.

    python benchmarks/gemm_lib_ab.py --model /tmp/peers/tiny-llama --before /path/to/old/gemm.cpp
    python benchmarks/gemm_lib_ab.py --model /tmp/peers/small-llama --before OLD --seqs 1 --steps 16

"after" is this checkout's gemm.cpp, "before" the given source, built with the same flags. The
model loads once (its weights packed by this checkout's `ps_gemm_pack`: both builds must share
the packed layout, which the script checks by ABI version and panel width); then, round after
round, each build serves `--steps` decode steps of `--seqs` running requests (128-token prompts
of random ids, greedy), the order of the two alternating by round. Every step is timed alone;
it prints each side's 10th percentile and median step time (the 10th percentile is the steps
that no other load slowed: with two threads a step waits whole time slices when another process
holds a core), tok/s at that step time, and after / before.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import time
from pathlib import Path

from common import quantile  # noqa: E402 (benchmarks/ is the script's directory)



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--before", required=True, help="the gemm.cpp to compare against")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per side per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve import LLM, SamplingParams, native
    from pagedserve.model.cpu import gemm

    after = gemm.load_gemm()
    source = Path(args.before).resolve()
    compiler = native.find_compiler()
    path = native.library_path(source, compiler)
    if not path.exists():
        native.compile_library(compiler, source, path)
    before = ctypes.CDLL(str(path))
    before.ps_abi_version.restype = ctypes.c_int
    gemm.bind(before)
    if (before.ps_abi_version(), before.ps_gemm_panel_width()) != (after.ps_abi_version(), after.ps_gemm_panel_width()):
        raise SystemExit("the two builds differ in ABI or panel width: their packed weights would differ")
    libs = {"before": before, "after": after}

    steps_per_request = args.rounds * 2 * (args.steps + 1) + 16
    llm = LLM(model=args.model, dtype="float32", max_model_len=128 + steps_per_request + 16, max_num_seqs=args.seqs,
              enable_prefix_caching=False, kv_cache_memory=2 * 2**30)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps_per_request, ignore_eos=True, temperature=0.0)
    for i in range(args.seqs):
        engine.add_request(f"ab-{i}", [rng.randrange(3, vocab) for _ in range(128)], params)
    scheduler = engine.engine_core.scheduler
    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in libs}
    clock = time.perf_counter
    for round_ in range(args.rounds):
        for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            lib = libs[name]
            gemm.load_gemm = lambda lib=lib: lib  # gemm.linear looks it up on every call
            engine.step()  # the first step after a switch is not counted
            for _ in range(args.steps):
                t0 = clock()
                engine.step()
                times[name].append(clock() - t0)
    gemm.load_gemm = lambda: after
    print(f"{args.model}: {args.seqs} running, torch threads {torch.get_num_threads()}, {args.rounds} rounds x "
          f"{args.steps} steps per side; load average {os.getloadavg()[0]:.1f}")
    p10 = {name: quantile(t, 0.1) for name, t in times.items()}
    med = {name: quantile(t, 0.5) for name, t in times.items()}
    for name in libs:
        print(f"  {name:>6}: step p10 {p10[name] * 1e3:7.3f} ms ({args.seqs / p10[name]:7.1f} tok/s), "
              f"median {med[name] * 1e3:7.3f} ms ({args.seqs / med[name]:7.1f} tok/s)")
    print(f"  after / before step time: p10 {p10['after'] / p10['before']:.3f}, median {med['after'] / med['before']:.3f}")


if __name__ == "__main__":
    main()
