"""Where one engine step's time goes, at a given number of running requests.

    python benchmarks/step_breakdown.py --model /tmp/peers/tiny-llama --seqs 1,32,256
    python benchmarks/step_breakdown.py --model /tmp/peers/small-llama --seqs 32 --threads 2

Runs LLM.generate on N requests (128-token prompts of random ids, greedy, EOS ignored) and
times each part of every decode step by wrapping the engine's own functions (no change to the
engine). Each part's time is its own, without the parts it calls:

  schedule    Scheduler.schedule
  input prep  the runner's per-step diffs (_apply_diffs) + attention metadata + input tensors
  forward     the model forward, split by layer kind: embed, rope table (cos/sin of the
              step's positions), norms (every RMSNorm, the residual adds and the final norm),
              attn GEMM (qkv + o projections), rope (rotating q and k), attention (the K/V
              write and the paged attention), MLP GEMM (gate_up + down), silu*up, native
              (where the model runs as one C++ call, model/cpu/decoder.py: all the layers and
              the final norm; the kinds before it are then empty), and glue (what the forward
              does between those: views, splits, the layer loop)
  LM head     compute_logits (the vocabulary GEMM)
  sampler     the rest of _sample: the sampler and the per-request result
  update      Scheduler.update_from_output
  outputs     OutputProcessor.process_outputs (detokenization, stop strings, RequestOutputs)
  other       the rest of the step: EngineCore.step and ModelRunner.execute around the parts,
              observers, the stop-string finishes

Prints milliseconds per decode step and each part's share, and the share of everything outside
forward + LM head (the engine's own work).

    python benchmarks/step_breakdown.py --issue32 --clock thread --threads 1

runs issue 32's breakdown: 1, 32 and 256 running on the 19M model, 32 on the 246M (ISSUE32_PLAN,
each model in its own process; `--plan 'MODEL=SEQS;MODEL=SEQS'` for others), then checks the
goal that the engine's work is at most 5% of the step at 32 on the 246M. The breakdown wraps about 10 functions per layer, so its
own cost (~1 us a wrapped call) is in the parts it wraps.

Instruction counts (repeatable on a shared machine, where milliseconds are not):

    python benchmarks/step_breakdown.py --model M --seqs 1,32 --callgrind [--before /path/to/other/checkout]

runs each N under `valgrind --tool=callgrind` with instrumentation switched on only around
--callgrind-steps decode steps (callgrind client requests from a tiny C shim, so start-up,
loading and prefill are not counted) and prints instructions per decode step, nothing wrapped;
with --before, the same for that checkout (PYTHONPATH) in alternation, and the ratio.
`--callgrind-parts` adds the same breakdown as above in instructions (a callgrind dump at every
part's entry and exit, each labelled with the part it closes; the wrappers' own instructions are
then counted too, so read the total of that run apart from the unwrapped one). Valgrind emulates
no AVX-512: the C++ kernels are built for AVX2 there (a CXX wrapper rewrites -march=native) and
torch picks its AVX2 kernels, so read the counts as the engine's relative cost, not the ISA's.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ISSUE32_PLAN = "/tmp/peers/tiny-llama=1,32,256;/tmp/peers/small-llama=32"
ENGINE_GOAL = 0.05  # issue 32: the work outside forward + LM head, at 32 running on the 246M
PARTS = ["schedule", "input prep", "forward", "LM head", "sampler", "update", "outputs", "other"]
FORWARD_KINDS = ["embed", "rope table", "norms", "attn GEMM", "rope", "attention", "MLP GEMM", "silu*up", "native",
                 "glue"]
# What the step's engine work is: everything but the model forward and the LM head.
ENGINE_PARTS = ["schedule", "input prep", "sampler", "update", "outputs", "other"]


class Probe:
    """Exclusive accounting over nested parts: a wrapped call's cost is its own, less that of
    the wrapped calls inside it. Timing: perf_counter per part. Under callgrind (`counter`): a
    dump at each boundary, labelled with the part whose interval it closes."""

    def __init__(self, counter: "CallgrindShim | None" = None, clock=time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False
        self.counter = counter
        self._stack: list[list] = []  # [part, start, time in wrapped children]

    def enter(self, part: str) -> None:
        if self.counter is not None:
            self.counter.dump(self._stack[-1][0] if self._stack else "other")
            self._stack.append([part, 0.0, 0.0])
            return
        self._stack.append([part, self.clock(), 0.0])

    def exit(self) -> None:
        part, start, children = self._stack.pop()
        if self.counter is not None:
            self.counter.dump(part)
            return
        elapsed = self.clock() - start
        self.totals[part] += elapsed - children
        if self._stack:
            self._stack[-1][2] += elapsed

    def timed(self, inner, part: str):
        probe = self

        def timed(*args, **kwargs):
            if not probe.active:
                return inner(*args, **kwargs)
            probe.enter(part)
            try:
                return inner(*args, **kwargs)
            finally:
                probe.exit()

        return timed

    def wrap(self, obj, name: str, part: str) -> None:
        """obj.name(...) is timed as `part` (an instance attribute over the method)."""
        setattr(obj, name, self.timed(getattr(obj, name), part))

    def wrap_callable(self, obj, name: str, part: str) -> None:
        """obj.name is an object called as obj.name(...) and used otherwise too: a proxy."""
        setattr(obj, name, TimedProxy(getattr(obj, name), self.timed(getattr(obj, name), part)))


class TimedProxy:
    def __init__(self, inner, timed_call) -> None:
        self.__dict__["_inner"], self.__dict__["_call"] = inner, timed_call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def instrument(engine, probe: Probe) -> None:
    """Wrap the step's parts (the table in the module docstring)."""
    from pagedserve.model import llama
    from pagedserve.model.cpu import fused

    core, runner = engine.engine_core, engine.executor
    model = runner.model
    probe.wrap(engine, "step", "other")
    probe.wrap(core.scheduler, "schedule", "schedule")
    probe.wrap(core.scheduler, "update_from_output", "update")
    probe.wrap(runner, "_apply_diffs", "input prep")
    probe.wrap(runner, "_prepare_inputs", "input prep")
    probe.wrap(model, "forward", "glue")
    probe.wrap(model, "compute_logits", "LM head")
    probe.wrap(runner, "_sample", "sampler")
    probe.wrap(engine.output_processor, "process_outputs", "outputs")
    # the forward by layer kind (a Llama-family model; other models' layers count as glue)
    if hasattr(model, "embed_tokens"):
        probe.wrap(model.embed_tokens, "forward", "embed")
    if hasattr(model, "rotary"):
        probe.wrap_callable(model, "rotary", "rope table")
    for layer in getattr(model, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj")):
            if hasattr(owner, name):
                probe.wrap(getattr(owner, name), "forward", "attn GEMM")
        for owner, name in ((mlp, "gate_up_proj"), (mlp, "down_proj")):
            if hasattr(owner, name):
                probe.wrap(getattr(owner, name), "forward", "MLP GEMM")
    for name, part in (("rms_norm", "norms"), ("add_rms_norm", "norms"), ("apply_rotary", "rope"),
                       ("silu_and_mul", "silu*up")):
        probe.wrap(fused, name, part)
    probe.wrap(llama, "paged_attention", "attention")
    # the forward as one C++ call (model/cpu/decoder.py): every layer and the final norm in "native"
    if getattr(model, "native_forward", None) is not None:
        probe.wrap(model.native_forward, "forward", "native")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--seqs", default="1,32,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: this thread's CPU time (steadier on a shared machine; with --threads 1 "
                         "the forward runs in it too)")
    ap.add_argument("--callgrind", action="store_true", help="instructions per decode step under callgrind")
    ap.add_argument("--callgrind-steps", type=int, default=8)
    ap.add_argument("--callgrind-parts", action="store_true",
                    help="with --callgrind: also the breakdown by part, in instructions (a second run per N)")
    ap.add_argument("--before", default=None, help="with --callgrind: another checkout to count alike")
    ap.add_argument("--plan", default=None, help="'MODEL=SEQS;MODEL=SEQS': each model in its own process")
    ap.add_argument("--issue32", action="store_true", help=f"--plan '{ISSUE32_PLAN}' and the 5%% check")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-parts", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.issue32 or args.plan:
        return run_plan(args.plan or ISSUE32_PLAN, args.issue32)
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
    runner = engine.executor
    counter = CallgrindShim() if args.child else None
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    probe = Probe(counter if args.child_parts else None, clock)
    if not args.child or args.child_parts:
        instrument(engine, probe)
    step = engine.step
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    if not args.child:
        print(f"{args.model}: {sum(t.numel() for t in (*runner.model.parameters(), *runner.model.buffers())) / 1e6:.1f}M parameters, "
              f"{args.dtype}, torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens; "
              f"load average {os.getloadavg()[0]:.1f}")
    rows = []
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
            probe.active = True
            for _ in range(args.callgrind_steps):
                step()
            probe.active = False
            counter.stop()
            print(f"CALLGRIND_STEPS {args.callgrind_steps}", flush=True)
            return
        probe.totals.clear()
        probe.active = True
        steps, t0 = 0, clock()
        while engine.has_unfinished_requests():
            step()
            steps += 1
        wall = clock() - t0
        probe.active = False
        rows.append((n, {p: v / steps * 1e3 for p, v in probe.totals.items()}, wall / steps * 1e3))
    print_breakdown(rows, "ms" if args.clock == "wall" else "ms of thread CPU time")


def print_breakdown(rows: list[tuple[int, dict[str, float], float]], unit: str) -> None:
    """rows: (running, cost per part or forward kind, whole step), per decode step in `unit`."""
    scale = "{:>7.2f}"
    shares: list[str] = []
    print(f"\nper decode step, {unit} (share of the step); forward = the kinds below; "
          f"engine = all but forward + LM head")
    print(f"{'running':>8} {'step':>8} " + " ".join(f"{p:>12}" for p in PARTS) + f" {'engine':>12}")
    for n, cost, step in rows:
        cost = dict(cost)
        cost["forward"] = sum(cost.get(k, 0.0) for k in FORWARD_KINDS)
        cost["other"] = cost.get("other", 0.0) + max(0.0, step - sum(cost.get(p, 0.0) for p in PARTS))
        engine = sum(cost[p] for p in ENGINE_PARTS)
        print(f"{n:>8} {step:>8.2f} " + " ".join(f"{scale.format(cost.get(p, 0.0))} {cost.get(p, 0.0) / step:>4.0%}"
                                                for p in PARTS) + f" {scale.format(engine)} {engine / step:>4.0%}")
        shares.append(f"ENGINE_SHARE {n} {engine / step:.4f}")
    print(f"\nthe forward by layer kind, {unit} per decode step (share of the step)")
    print(f"{'running':>8} " + " ".join(f"{k:>12}" for k in FORWARD_KINDS))
    for n, cost, step in rows:
        print(f"{n:>8} " + " ".join(f"{scale.format(cost.get(k, 0.0))} {cost.get(k, 0.0) / step:>4.0%}"
                                    for k in FORWARD_KINDS))
    print("\n".join(shares))


def run_plan(plan: str, check: bool) -> None:
    """Each MODEL=SEQS entry in its own process (this script, the other flags as given); with
    `check`, issue 32's goal on the last entry's 32-running row."""
    passed = [a for a in sys.argv[1:] if a not in ("--issue32",)]
    if "--plan" in passed:
        i = passed.index("--plan")
        del passed[i:i + 2]
    shares: dict[tuple[str, int], float] = {}
    for entry in plan.split(";"):
        model, _, seqs = entry.partition("=")
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--model", model, "--seqs", seqs]
                              + passed, capture_output=True, text=True)
        print(done.stdout, end="", flush=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{model}: exit {done.returncode}")
        for line in done.stdout.splitlines():
            if line.startswith("ENGINE_SHARE "):
                _, n, share = line.split()
                shares[(model, int(n))] = float(share)
    if check:
        model = plan.split(";")[-1].partition("=")[0]
        share = shares.get((model, 32))
        if share is not None:
            verdict = "holds" if share <= ENGINE_GOAL else "does not hold"
            print(f"\nissue 32: engine work at 32 running on {model}: {share:.1%} of the step "
                  f"(goal <= {ENGINE_GOAL:.0%}: {verdict})")


SHIM = r"""
#include <valgrind/callgrind.h>
extern "C" void ps_cg_start() { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
extern "C" void ps_cg_stop() { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
extern "C" void ps_cg_dump(const char* label) { CALLGRIND_DUMP_STATS_AT(label); }
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
        lib = work / f"cg_shim_{hashlib.sha256(SHIM.encode()).hexdigest()[:12]}.so"
        if not lib.exists():
            src = work / f"{lib.stem}.cpp"
            src.write_text(SHIM)
            subprocess.run([os.environ.get("PS_REAL_CXX", "c++"), "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)],
                           check=True)
        self.lib = ctypes.CDLL(str(lib))
        self.lib.ps_cg_dump.argtypes = [ctypes.c_char_p]
        self._labels: dict[str, bytes] = {}

    def start(self) -> None:
        self.lib.ps_cg_start()

    def stop(self) -> None:
        self.lib.ps_cg_stop()

    def dump(self, label: str) -> None:
        encoded = self._labels.get(label)
        if encoded is None:
            encoded = self._labels[label] = label.encode()
        self.lib.ps_cg_dump(encoded)


def run_callgrind(root: Path, args, n: int, work: Path, parts: bool) -> dict[str, int]:
    """Instructions of the counted decode steps at `n` running requests, with `root`'s
    pagedserve, by the label of the dump that closed them ("other" for the final dump)."""
    out = work / f"cg.{os.getpid()}.{abs(hash((str(root), n, parts)))}"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
           sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--seqs", str(n),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype,
           "--callgrind-steps", str(args.callgrind_steps), "--threads", "1"] + (["--child-parts"] if parts else [])
    env = dict(os.environ, PYTHONPATH=str(root), CXX=str(work / "c++"), OMP_NUM_THREADS="1",
               PAGEDSERVE_CACHE_DIR=str(work / "cache"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if "CALLGRIND_STEPS" not in done.stdout:
        raise RuntimeError(f"callgrind run failed ({root}, n={n}):\n{done.stderr[-3000:]}")
    by_label: dict[str, int] = defaultdict(int)
    for dump in work.glob(out.name + ".*"):
        text = dump.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        found = re.search(r"^totals:\s+(\d+)", text, re.M)  # each dump holds the costs since the last (then zeroed)
        by_label[label.group(1).strip() if label else "other"] += int(found.group(1)) if found else 0
        dump.unlink()
    return by_label


def compare_instructions(args) -> None:
    import shutil

    work = Path(tempfile.gettempdir()) / "pagedserve-callgrind"
    work.mkdir(exist_ok=True)
    (work / "c++").write_text(AVX2_CXX.format(cxx=shutil.which(os.environ.get("CXX") or "c++")))
    (work / "c++").chmod(0o755)
    after = Path(__file__).resolve().parents[1]
    sides = [("after", after)] + ([("before", Path(args.before).resolve())] if args.before else [])
    steps = args.callgrind_steps
    print(f"{args.model}, {args.dtype}: instructions per decode step under callgrind "
          f"({steps} steps counted, one thread, AVX2 kernels); load average {os.getloadavg()[0]:.1f}")
    seqs = [int(s) for s in args.seqs.split(",")]
    for n in seqs:
        counts = {name: sum(run_callgrind(root, args, n, work, False).values()) // steps for name, root in sides}
        line = f"  running {n:>4}: " + "  ".join(f"{name} {c / 1e6:9.2f} M" for name, c in counts.items())
        if "before" in counts:
            line += f"  after/before {counts['after'] / counts['before']:.3f}"
        print(line, flush=True)
    if args.callgrind_parts:
        for name, root in sides:
            rows = []
            for n in seqs:
                by_label = run_callgrind(root, args, n, work, True)
                cost = {k: v / steps / 1e6 for k, v in by_label.items()}
                rows.append((n, cost, sum(cost.values())))
            print(f"\n{name} ({root}), every part wrapped:")
            print_breakdown(rows, "M instructions")


if __name__ == "__main__":
    main()
