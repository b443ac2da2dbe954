"""pagedserve's engine on a GPU: greedy parity with HF transformers on the same device, and decode
throughput and bandwidth use per attention backend (benchmarks/gpu_check.sh runs it; not CI).

    python benchmarks/gpu_engine_check.py [--device cuda] [--size 100m] [--out FILE.json]

For each backend (the Triton kernels, the torch reference) one child process loads the checkpoint in
bf16 and runs: 128 prompts of 128 random ids x 128 new tokens (output tok/s, prefill included), one
prompt x 128 new tokens (the batch-1 decode step, and its bandwidth use: weights read per step over
the step's time, against this card's measured copy bandwidth), and 8 prompts x 32 greedy tokens. One
more child runs the Triton kernels in fp32 for the parity that must be exact. HF (fp32, the same
device) is the reference: fp32 greedy tokens must equal HF's token for token; bf16's agreement is
reported (bf16 and fp32 may part at near-ties).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

WORKER = r'''
import json, sys, time, numpy as np, torch
from pagedserve import LLM, SamplingParams
path, device, dtype, batch, parity_prompts, top = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(10, top, size=128)] for _ in range(max(batch, parity_prompts))]
llm = LLM(path, device=device, dtype=dtype, max_model_len=1024, max_num_seqs=256)
def run(ps, n):
    sync(); t = time.perf_counter()
    outs = llm.generate(ps, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    sync(); return outs, time.perf_counter() - t
run(prompts[:4], 4)  # warm-up: kernels compiled, pool touched
res = {"dtype": dtype}
if batch:
    _, dt = run(prompts[:batch], 128)
    res["out_tok_s"] = batch * 128 / dt
    _, one = run(prompts[:1], 1)
    _, dt1 = run(prompts[:1], 129)
    res["decode_step_s_at_1"] = (dt1 - one) / 128  # 128 decode steps: the prefill's run taken out
few, _ = run(prompts[:parity_prompts], 32)
res["greedy"] = [o.outputs[0].token_ids for o in few]
print(json.dumps(res))
'''


def child(path: Path, device: str, backend: str, dtype: str, batch: int, parity_prompts: int) -> dict:
    env = dict(os.environ, PAGEDSERVE_ATTENTION_BACKEND=backend,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", WORKER, str(path), device, dtype, str(batch), str(parity_prompts),
                        str(top_id(path))],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr[-4000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def top_id(path: Path) -> int:
    """Prompts draw ids in [10, this): below 30,000 and inside the vocabulary."""
    return min(30000, json.loads((path / "config.json").read_text())["vocab_size"])


def weight_bytes(path: Path, dtype_bytes: int) -> int:
    from common import param_count
    return param_count(path) * dtype_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="100m", help="benchmarks/common.py SIZES")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from common import benchmark_checkpoint

    path = benchmark_checkpoint(args.size)
    copy_tbps = None
    if args.device == "cuda":
        n = 2**30
        a, b = torch.empty(n, device="cuda", dtype=torch.uint8), torch.empty(n, device="cuda", dtype=torch.uint8)
        b.copy_(a)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            b.copy_(a)
        e.record()
        e.synchronize()
        copy_tbps = 10 * 2 * n / (s.elapsed_time(e) / 1e3) / 1e12
        del a, b
        torch.cuda.empty_cache()
        print(f"device copy: {copy_tbps:.2f} TB/s (read + write)")
    runs = {"triton bf16": ("triton", "bfloat16", args.batch), "torch bf16": ("torch", "bfloat16", args.batch),
            "triton fp32": ("triton", "float32", 0)}
    res = {}
    for name, (backend, dtype, batch) in runs.items():
        res[name] = child(path, args.device, backend, dtype, batch, args.parity_prompts)
        r = res[name]
        if "error" in r:
            print(f"{name}: FAILED\n{r['error']}")
            continue
        if batch:
            step = r["decode_step_s_at_1"]
            mbu = weight_bytes(path, 2) / step / 1e12
            line = (f"{name}: {r['out_tok_s']:.0f} output tok/s ({batch} prompts x 128 new, prefill included); "
                    f"batch-1 decode step {step * 1e3:.2f} ms = {mbu:.3f} TB/s of weights")
            if copy_tbps:
                line += f" ({100 * mbu / (copy_tbps / 2):.1f}% of the card's copy rate)"
            print(line, flush=True)
    if "out_tok_s" in res.get("triton bf16", {}) and "out_tok_s" in res.get("torch bf16", {}):
        print(f"triton / torch throughput: {res['triton bf16']['out_tok_s'] / res['torch bf16']['out_tok_s']:.2f}x")

    import numpy as np
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, top_id(path), size=128)]
               for _ in range(max(args.batch, args.parity_prompts))]
    want = []
    with torch.inference_mode():
        for p in prompts[:args.parity_prompts]:
            ids = torch.tensor([p], device=args.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False)
            want.append(out[0, len(p):].tolist())
    res["hf_fp32_greedy"] = want
    total = 32 * len(want)
    for name, r in res.items():
        if not isinstance(r, dict) or "greedy" not in r:
            continue
        same = sum(a == b for w, g in zip(want, r["greedy"]) for a, b in zip(w, g))
        whole = sum(w == g for w, g in zip(want, r["greedy"]))
        r["tokens_equal_hf"] = same
        print(f"{name} vs HF fp32 greedy: {same} / {total} tokens equal, {whole} / {len(want)} sequences identical")
    res["copy_tbps"] = copy_tbps
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
