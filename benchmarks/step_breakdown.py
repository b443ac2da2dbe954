"""Where one engine step's time goes, at a given number of running requests.

    python benchmarks/step_breakdown.py --model /tmp/peers/tiny-llama --seqs 1,32,256
    python benchmarks/step_breakdown.py --model /tmp/peers/small-llama --seqs 32 --threads 2

Runs LLM.generate on N requests (128-token prompts of random ids, greedy, EOS ignored) and
times each part of every decode step by wrapping the engine's own functions (no change to the
engine): schedule, input prep (runner diffs + attention metadata + input tensors), model
forward, logits + sampling, update (the scheduler's), outputs (detokenization, stop strings,
RequestOutputs). Prints milliseconds per decode step and each part's share, and the share of
everything outside the model forward.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

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
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
