"""vLLM's hand-over of a tokenized request to its engine core, in API-process CPU time.

    OMP_NUM_THREADS=1 /tmp/peers/vllm/bin/python benchmarks/vllm_handover_probe.py \
        [--model /tmp/serving-endpoint-probe/empty-model] [--out results/vllm_handover_probe.json]

Runs under vLLM's own venv (vLLM only, never pagedserve). AsyncLLM as `vllm serve` builds it (the engine
core in its own process), on the near-empty checkpoint benchmarks/serving_endpoint_probe.py writes; one
request at a time, prompts of token ids (the server's renderer has tokenized them by then) of 16 / 512 /
2,048 tokens, 1 output. AsyncLLM.add_request is timed in this thread's CPU time (time.thread_time, so
the machine's load does not enter): input processing (validation, the EngineCoreRequest), the output
processor's add_request and the send to the engine core — the loop's work after the tokenizer await,
which the simulator's admission split (sim/host_overhead.py, ServingOverhead) did not price.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PROMPTS = (16, 512, 2048)
REPEATS = 12


async def run(args) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    spent: list[float] = []
    orig = AsyncLLM.add_request

    async def add_request(self, *a, **k):
        t0 = time.thread_time()
        try:
            return await orig(self, *a, **k)
        finally:
            spent.append(time.thread_time() - t0)

    AsyncLLM.add_request = add_request
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, load_format="dummy", dtype="float32", max_model_len=4096, max_num_seqs=128,
        max_num_batched_tokens=4096, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    out = {}
    k = 0
    for rnd in range(args.rounds + 1):  # round 0 warms up, dropped
        for n in PROMPTS:
            spent.clear()
            for j in range(REPEATS):
                k += 1
                prompt = {"prompt_token_ids": [100 + (i * 7 + k) % 500 for i in range(n)]}
                async for _ in engine.generate(prompt, params, request_id=f"r{k}"):
                    pass
            if rnd:
                out.setdefault(str(n), []).extend(spent)
    engine.shutdown()
    return {n: {"median_s": statistics.median(v), "min_s": min(v), "samples": len(v)} for n, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/serving-endpoint-probe/empty-model")
    ap.add_argument("--out", default="results/vllm_handover_probe.json")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import vllm

    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    got = asyncio.run(run(args))
    load1 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    ns = sorted(int(n) for n in got)
    # a + b x prompt tokens through the medians (least squares)
    xs, ys = ns, [got[str(n)]["median_s"] for n in ns]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    a = max(0.0, my - b * mx)
    res = {"vllm": vllm.__version__, "model": args.model, "when": when, "load_before": load0, "load_after": load1,
           "clock": "thread CPU time", "by_prompt": got, "fit": {"handover_s": a, "handover_per_prompt_token_s": b}}
    for n in ns:
        print(f"prompt {n:5d}: add_request {got[str(n)]['median_s'] * 1e3:.3f} ms median ({got[str(n)]['samples']} requests)")
    print(f"fit: {a * 1e3:.3f} ms + {b * 1e9:.1f} ns/prompt token; load {load0} -> {load1}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
