"""Offline throughput: pagedserve (continuous batching over a paged pool) vs HF transformers
static batching (padded batches), same checkpoint, same requests, same CPU, one run.

    python benchmarks/offline_throughput.py                # 100M model, 128 requests (slow on 2 cores)
    python benchmarks/offline_throughput.py --size 20m --num-requests 64   # quicker

Prints tokens/s of both, the ratio, and pagedserve's KV waste at peak (slots allocated
vs tokens live), next to what HF's padded batch reserves.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from common import benchmark_checkpoint, param_count, write_result


def make_requests(n: int, seed: int, vocab: int, prompt_range=(32, 512), output_range=(16, 256)):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(10, vocab) for _ in range(p)], rng.randint(*output_range)))
    return reqs


def run_pagedserve(path, reqs, args):
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(path), kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype="float32")
    engine = llm.engine
    peak = {"allocated_slots": 0, "live_tokens": 0, "usage": 0.0}
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    out_tokens = 0
    steps = 0
    while engine.has_unfinished_requests():
        # Sample occupancy before the step frees finished requests: allocated vs live.
        for o in engine.step():
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
        steps += 1
        allocated = engine.kv_cache_manager.num_used_blocks * engine.config.block_size
        live = sum(r.num_computed_tokens for r in engine.scheduler.running)
        if allocated > peak["allocated_slots"]:
            peak = {"allocated_slots": allocated, "live_tokens": live, "usage": engine.kv_cache_manager.usage}
    elapsed = time.perf_counter() - t0
    waste = 1 - peak["live_tokens"] / max(peak["allocated_slots"], 1)
    return {"seconds": elapsed, "output_tokens": out_tokens, "steps": steps,
            "preemptions": engine.scheduler.total_preemptions, "peak": peak, "kv_waste_at_peak": waste}


def run_hf(path, reqs, batch_size):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    t0 = time.perf_counter()
    out_tokens = 0
    reserved = live = 0
    with torch.inference_mode():
        for start in range(0, len(reqs), batch_size):
            batch = reqs[start:start + batch_size]
            width = max(len(p) for p, _ in batch)
            new = max(n for _, n in batch)  # a static batch runs until its longest request is done
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(batch):  # left padding
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
            out_tokens += sum(n for _, n in batch)  # only the tokens each request asked for are useful
            reserved = max(reserved, len(batch) * (width + new))
            live = max(live, sum(len(p) + n for p, n in batch))
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "output_tokens": out_tokens, "kv_slots_reserved_at_peak": reserved,
            "kv_waste_at_peak": 1 - live / reserved}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="100m")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = benchmark_checkpoint(args.size)
    import json
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    reqs = make_requests(args.num_requests, args.seed, vocab)
    in_tokens = sum(len(p) for p, _ in reqs)
    print(f"model: random Llama {param_count(path) / 1e6:.0f}M params, fp32, torch threads={torch.get_num_threads()}")
    print(f"workload: {len(reqs)} requests, {in_tokens} prompt tokens, {sum(n for _, n in reqs)} output tokens "
          f"(prompts 32-512, outputs 16-256, ignore_eos)")
    ps = run_pagedserve(path, reqs, args)
    hf = run_hf(path, reqs, args.hf_batch_size)
    ps_tps = ps["output_tokens"] / ps["seconds"]
    hf_tps = hf["output_tokens"] / hf["seconds"]
    ps_total = (ps["output_tokens"] + in_tokens) / ps["seconds"]
    hf_total = (hf["output_tokens"] + in_tokens) / hf["seconds"]
    print(f"{'':28}{'pagedserve':>14}{'HF static':>14}{'ratio':>9}")
    print(f"{'wall seconds':28}{ps['seconds']:>14.1f}{hf['seconds']:>14.1f}{hf['seconds'] / ps['seconds']:>8.2f}x")
    print(f"{'output tokens/s':28}{ps_tps:>14.1f}{hf_tps:>14.1f}{ps_tps / hf_tps:>8.2f}x")
    print(f"{'total (in+out) tokens/s':28}{ps_total:>14.1f}{hf_total:>14.1f}{ps_total / hf_total:>8.2f}x")
    print(f"{'KV waste at peak':28}{ps['kv_waste_at_peak']:>13.1%}{hf['kv_waste_at_peak']:>13.1%}")
    print(f"pagedserve peak: {ps['peak']['allocated_slots']} slots allocated for {ps['peak']['live_tokens']} live tokens "
          f"(pool usage {ps['peak']['usage']:.1%}); {ps['steps']} steps, {ps['preemptions']} preemptions. "
          f"HF batch {args.hf_batch_size}: {hf['kv_slots_reserved_at_peak']} slots reserved at peak.")
    path = write_result("offline_throughput", {"args": vars(args), "pagedserve": ps, "hf": hf,
                                               "output_tps_ratio": ps_tps / hf_tps})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
