"""Pipeline parallelism on this CPU, measured side by side in one run: pp=1 (one mp worker)
vs pp=2 (two mp workers, gloo), with and without micro-batching, on the same tiny MoE
checkpoint and requests, offline. The prompts arrive together, so the first steps are large
prefill steps (micro-batched) and the rest decode steps (run whole).

Per layout: output tokens/s, mean engine step (wall of LLM.generate / steps), each rank's
execute time per step, and the pipeline's communication: the sends (stage 0 handing its
hidden states and residual on: the transfer) and the receive waits (stage 1 waiting for
stage 0: transfer plus the idle time of a stage with nothing to do; see the README's Scaling
out on micro-batching).

    python benchmarks/pipeline_parallel.py [--arch mixtral] [--layers 4] [--hidden 256]
        [--num-prompts 16] [--prompt-len 128] [--new-tokens 32] [--threads 1]

Results: results/pipeline_parallel.json.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from common import write_result


def checkpoint(arch: str, layers: int, hidden: int) -> Path:
    from checkpoints import make_checkpoint

    path = Path("/tmp/pagedserve-bench") / f"{arch}-pp-{layers}x{hidden}"
    if not (path / "config.json").exists():
        make_checkpoint(path, arch, hidden=hidden, layers=layers, heads=8, kv_heads=4, inter=2 * hidden,
                        vocab=4096, max_pos=2048, init_std=0.02)
    return path


def run(path: Path, pp: int, prompts, new_tokens: int, micro_batch_tokens: int = 256) -> dict:
    from pagedserve import LLM, SamplingParams

    os.environ["PAGEDSERVE_PP_MICRO_BATCH_TOKENS"] = str(micro_batch_tokens)  # read by the ranks at spawn
    llm = LLM(str(path), pipeline_parallel_size=pp, distributed_executor_backend="mp", max_model_len=1024,
              kv_cache_memory="256MiB", max_num_seqs=16, enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        llm.engine.executor.set_comm_observer(True)  # the ranks time their sends only when asked
        llm.engine.executor.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        stats = llm.engine.executor.worker_stats()
    finally:
        llm.shutdown()
    steps = stats[0]["num_steps"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"pp": pp, "micro_batch_tokens": micro_batch_tokens, "micro_batches": stats[-1]["pp_micro_batches"],
            "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall, "steps": steps,
            "step_ms": 1e3 * wall / steps,
            "ranks": [{"rank": s["rank"], "execute_ms_per_step": 1e3 * s["execute_seconds"] / steps,
                       "send_ms_per_step": 1e3 * s["pp_send"] / steps, "recv_ms_per_step": 1e3 * s["pp_recv"] / steps,
                       "bytes_sent_per_step": s["pp_bytes"] / steps} for s in stats]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="mixtral", choices=["mixtral", "qwen2_moe", "deepseek_v3", "llama"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    path = checkpoint(args.arch, args.layers, args.hidden)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4096) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    results = [run(path, 1, prompts, args.new_tokens), run(path, 2, prompts, args.new_tokens, 0),
               run(path, 2, prompts, args.new_tokens)]
    print(f"{args.arch}, {args.layers} layers, hidden {args.hidden}; {args.num_prompts} prompts of {args.prompt_len} "
          f"+ {args.new_tokens} tokens; {args.threads} torch thread(s) per rank; load average "
          f"{os.getloadavg()[0]:.1f}")
    base = results[0]["tok_per_s"]
    for r in results:
        mb = "" if r["pp"] == 1 else (f", micro-batches of >= {r['micro_batch_tokens']} tokens "
                                      f"({r['micro_batches']} in all)" if r["micro_batch_tokens"] else ", no micro-batching")
        print(f"  pp={r['pp']}{mb}: {r['tok_per_s']:.1f} tok/s ({r['tok_per_s'] / base:.2f}x), {r['steps']} steps, "
              f"{r['step_ms']:.2f} ms per step")
        for k in r["ranks"]:
            share = (k["send_ms_per_step"] + k["recv_ms_per_step"]) / max(k["execute_ms_per_step"], 1e-9)
            print(f"    rank {k['rank']}: execute {k['execute_ms_per_step']:.2f} ms/step, send "
                  f"{k['send_ms_per_step']:.3f} ms, receive wait {k['recv_ms_per_step']:.3f} ms "
                  f"({share:.0%} of its execute), {k['bytes_sent_per_step'] / 1024:.1f} KiB sent/step")
    print("results:", write_result("pipeline_parallel", {"args": vars(args), "layouts": results}))


if __name__ == "__main__":
    main()
