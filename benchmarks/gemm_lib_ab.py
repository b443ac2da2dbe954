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

`--dtype bfloat16` runs the model in bf16 (the bf16 GEMM where the CPU has AVX512-BF16).
`--prefill` times bursts instead of decode steps: each side in turn gets `--seqs` new requests
of 128-token prompts (max_tokens 1) and is timed from adding them to the last one finishing,
i.e. the burst's last TTFT (the 32 x 128 burst: `--seqs 32 --prefill`); per-burst quantiles.
`--threads 1 --cpu-time` times by the thread's CPU time instead of the wall clock: on a loaded
machine the only steady figure (a step preempted for a time slice is not charged for it).
"""
from __future__ import annotations

import argparse
import os
import random
import time

from common import gemm_build, quantile  # noqa: E402 (benchmarks/ is the script's directory)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--before", required=True, help="the gemm.cpp to compare against")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per side per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prefill", action="store_true", help="time bursts of --seqs prompts instead of decode steps")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by this thread's CPU time (needs --threads 1: the engine core and its GEMMs then "
                         "run on this thread), which a preempting process does not add to")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time needs --threads 1")
    args.clock = time.thread_time if args.cpu_time else time.perf_counter

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve import LLM, SamplingParams
    from pagedserve.model.cpu import gemm

    after = gemm.load_gemm()
    before = gemm_build(args.before)
    libs = {"before": before, "after": after}

    steps_per_request = args.rounds * 2 * (args.steps + 1) + 16
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=128 + steps_per_request + 16, max_num_seqs=args.seqs,
              enable_prefix_caching=False, kv_cache_memory=2 * 2**30)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    print(f"engine dtype {engine.dtype}")
    if args.prefill:
        prefill_ab(args, engine, libs, after, rng, vocab)
        return
    params = SamplingParams(max_tokens=steps_per_request, ignore_eos=True, temperature=0.0)
    for i in range(args.seqs):
        engine.add_request(f"ab-{i}", [rng.randrange(3, vocab) for _ in range(128)], params)
    scheduler = engine.engine_core.scheduler
    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in libs}
    clock = args.clock
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
    report(args, times, f"{args.seqs} running", "step", args.seqs)


def prefill_ab(args, engine, libs, after, rng, vocab) -> None:
    """Bursts of --seqs fresh 128-token prompts, the two builds in turn (a burst warms up first)."""
    from pagedserve import SamplingParams
    from pagedserve.model.cpu import gemm

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    counter = iter(range(10**9))

    def burst() -> float:
        prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(args.seqs)]
        t0 = args.clock()
        for prompt in prompts:
            engine.add_request(f"burst-{next(counter)}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return args.clock() - t0

    times: dict[str, list[float]] = {name: [] for name in libs}
    for round_ in range(args.rounds + 1):  # round 0 warms up both
        for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            lib = libs[name]
            gemm.load_gemm = lambda lib=lib: lib
            seconds = burst()
            if round_:
                times[name].append(seconds)
    gemm.load_gemm = lambda: after
    report(args, times, f"bursts of {args.seqs} x 128-token prompts", "burst", args.seqs * 128)


def report(args, times: dict[str, list[float]], what: str, unit: str, tokens: int) -> None:
    import torch

    print(f"{args.model} ({args.dtype}): {what}, torch threads {torch.get_num_threads()}, {args.rounds} rounds"
          + ("" if args.prefill else f" x {args.steps} steps") + " per side"
          + ("; thread CPU time" if args.cpu_time else "") + f"; load average {os.getloadavg()[0]:.1f}")
    p10 = {name: quantile(t, 0.1) for name, t in times.items()}
    med = {name: quantile(t, 0.5) for name, t in times.items()}
    for name in times:
        print(f"  {name:>6}: {unit} p10 {p10[name] * 1e3:8.2f} ms ({tokens / p10[name]:7.1f} tok/s), "
              f"median {med[name] * 1e3:8.2f} ms ({tokens / med[name]:7.1f} tok/s)")
    per = 1 if args.prefill else args.steps  # a round's timings per side, paired by round
    rounds = {name: [quantile(t[i:i + per], 0.5) for i in range(0, len(t), per)] for name, t in times.items()}
    ratios = sorted(a / b for a, b in zip(rounds["after"], rounds["before"]))
    print(f"  after / before {unit} time: p10 {p10['after'] / p10['before']:.3f}, median {med['after'] / med['before']:.3f}; "
          f"per round (each side's median, paired) min {ratios[0]:.3f} median {quantile(ratios, 0.5):.3f} max {ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
