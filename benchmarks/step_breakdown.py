"""Where one engine step's time goes, at a given number of running requests.

    python benchmarks/step_breakdown.py --model /tmp/peers/tiny-llama --seqs 1,32,256
    python benchmarks/step_breakdown.py --model /tmp/peers/small-llama --seqs 32 --threads 2

Runs LLM.generate on N requests (128-token prompts of random ids, greedy, EOS ignored) and
times each part of every decode step by wrapping the engine's own functions (no change to the
engine): schedule, input prep (runner diffs + attention metadata + input tensors), model
forward, logits + sampling, update (the scheduler's), outputs (detokenization, stop strings,
RequestOutputs). Prints milliseconds per decode step and each part's share, and the share of
everything outside the model forward.

Instruction counts (repeatable on a shared machine, where milliseconds are not):

    python benchmarks/step_breakdown.py --model M --seqs 1,32 --callgrind [--before /path/to/other/checkout]

runs each N under `valgrind --tool=callgrind` with instrumentation switched on only around
--callgrind-steps decode steps (callgrind client requests from a tiny C shim, so start-up,
loading and prefill are not counted) and prints instructions per decode step; with --before,
the same for that checkout (PYTHONPATH) in alternation, and the ratio. Valgrind emulates no
AVX-512: the C++ kernels are built for AVX2 there (a CXX wrapper rewrites -march=native) and
torch picks its AVX2 kernels, so read the counts as the engine's relative cost, not the ISA's.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PARTS = ["schedule", "input prep", "forward", "sample", "update", "outputs"]


class Timers:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)
        timers = self

        def timed(*args, **kwargs):
            if not timers.active:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timers.totals[part] += time.perf_counter() - t0

        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--seqs", default="1,32,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--callgrind", action="store_true", help="instructions per decode step under callgrind")
    ap.add_argument("--callgrind-steps", type=int, default=8)
    ap.add_argument("--before", default=None, help="with --callgrind: another checkout to count alike")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.callgrind:
        return compare_instructions(args)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve import LLM, SamplingParams

    seqs = [int(s) for s in args.seqs.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=max(seqs), max_num_batched_tokens=max(4096, args.prompt_len * max(seqs)),
              num_kv_blocks=max(seqs) * ((args.prompt_len + args.new_tokens) // 16 + 2),
              enable_prefix_caching=False, preemption_mode="recompute")
    engine = llm.engine
    core, runner = engine.engine_core, engine.executor
    timers = Timers()
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(runner, "_prepare_inputs", "input prep")
    timers.wrap(runner.model, "forward", "forward")
    timers.wrap(runner, "_sample", "sample")
    timers.wrap(engine.output_processor, "process_outputs", "outputs")
    step = engine.step
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    print(f"{args.model}: {sum(p.numel() for p in runner.model.parameters()) / 1e6:.1f}M parameters, "
          f"{args.dtype}, torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens")
    print(f"{'running':>8} {'ms/step':>8} " + " ".join(f"{p:>11}" for p in PARTS) + f" {'outside fwd':>11}")
    counter = CallgrindShim() if args.child else None
    for n in seqs:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0.0)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
        for i, p in enumerate(prompts):
            engine.add_request(f"b{n}-{i}", p, params)
        step()  # the prefill step(s) are not what is measured
        while engine.engine_core.scheduler.num_waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running):
            step()
        if counter is not None:  # under callgrind: count --callgrind-steps decode steps, nothing else
            step()
            step()
            counter.start()
            for _ in range(args.callgrind_steps):
                step()
            counter.stop()
            print(f"CALLGRIND_STEPS {args.callgrind_steps}", flush=True)
            return
        timers.totals.clear()
        timers.active = True
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            step()
            steps += 1
        wall = time.perf_counter() - t0
        timers.active = False
        ms = {p: timers.totals[p] / steps * 1e3 for p in PARTS}
        per_step = wall / steps * 1e3
        outside = per_step - ms["forward"]
        print(f"{n:>8} {per_step:>8.2f} " + " ".join(f"{ms[p]:>6.2f} {ms[p] / per_step:>3.0%}" for p in PARTS)
              + f" {outside:>6.2f} {outside / per_step:>3.0%}")


SHIM = r"""
#include <valgrind/callgrind.h>
extern "C" void ps_cg_start() { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
extern "C" void ps_cg_stop() { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""

AVX2_CXX = """#!/bin/sh
# valgrind emulates no AVX-512: build pagedserve's kernels for AVX2 (-march=native -> haswell)
for a in "$@"; do [ "$a" = "-march=native" ] && a="-march=haswell"; set -- "$@" "$a"; shift; done
exec {cxx} "$@"
"""


class CallgrindShim:
    """Callgrind's client requests (no-ops outside valgrind), compiled once into a tiny library."""

    def __init__(self) -> None:
        work = Path(tempfile.gettempdir()) / "pagedserve-callgrind"
        work.mkdir(exist_ok=True)
        lib = work / "cg_shim.so"
        if not lib.exists():
            src = work / "cg_shim.cpp"
            src.write_text(SHIM)
            subprocess.run([os.environ.get("PS_REAL_CXX", "c++"), "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)],
                           check=True)
        self.lib = ctypes.CDLL(str(lib))

    def start(self) -> None:
        self.lib.ps_cg_start()

    def stop(self) -> None:
        self.lib.ps_cg_stop()


def count_instructions(root: Path, args, n: int, work: Path) -> int:
    """Instructions per decode step at `n` running requests, with `root`'s pagedserve."""
    out = work / f"cg.{os.getpid()}.{abs(hash((str(root), n)))}"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
           sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--seqs", str(n),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype,
           "--callgrind-steps", str(args.callgrind_steps), "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(root), CXX=str(work / "c++"), OMP_NUM_THREADS="1",
               PAGEDSERVE_CACHE_DIR=str(work / "cache"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if "CALLGRIND_STEPS" not in done.stdout:
        raise RuntimeError(f"callgrind run failed ({root}, n={n}):\n{done.stderr[-3000:]}")
    total = 0
    for dump in work.glob(out.name + ".*"):
        text = dump.read_text(errors="replace")
        found = re.search(r"^totals:\s+(\d+)", text, re.M)  # (a dump's "summary:" is the part since the last)
        total += int(found.group(1)) if found else 0
        dump.unlink()
    return total // args.callgrind_steps


def compare_instructions(args) -> None:
    import shutil

    work = Path(tempfile.gettempdir()) / "pagedserve-callgrind"
    work.mkdir(exist_ok=True)
    (work / "c++").write_text(AVX2_CXX.format(cxx=shutil.which(os.environ.get("CXX") or "c++")))
    (work / "c++").chmod(0o755)
    after = Path(__file__).resolve().parents[1]
    sides = [("after", after)] + ([("before", Path(args.before).resolve())] if args.before else [])
    print(f"{args.model}, {args.dtype}: instructions per decode step under callgrind "
          f"({args.callgrind_steps} steps counted, one thread, AVX2 kernels)")
    for n in [int(s) for s in args.seqs.split(",")]:
        counts = {name: count_instructions(root, args, n, work) for name, root in sides}
        line = f"  running {n:>4}: " + "  ".join(f"{name} {c / 1e6:9.2f} M" for name, c in counts.items())
        if "before" in counts:
            line += f"  after/before {counts['after'] / counts['before']:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
