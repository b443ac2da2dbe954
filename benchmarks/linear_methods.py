"""Before/after for the linear-layer methods and bf16: pagedserve `LLM.generate` output tok/s on the
246M Llama with the old GEMM path (plain F.linear fp32, `PAGEDSERVE_LINEAR_METHOD=torch`), the
method chosen at start-up in fp32, and `--dtype bfloat16`; plus greedy agreement with HF
transformers in the same dtype.

    python benchmarks/linear_methods.py                      # 8 and 32 sequences, 128 + 128 tokens
    python benchmarks/linear_methods.py --batches 8 --new-tokens 64 --reps 1
    python benchmarks/linear_methods.py --configs 6,7   # bf16: prepacked oneDNN vs our AVX512-BF16 GEMM

Workload (as shared/peers/bench_pagedserve.py): 128-token prompts of fixed random ids, 128 new
tokens, greedy, EOS ignored, prefix caching off; every configuration runs once per repetition,
alternating, and the best repetition counts (the machine is shared: read the ratios).
Agreement: for each of --parity-prompts prompts, the share of the --parity-tokens greedy tokens
that equal HF's up to the first divergence, averaged (1.0 = identical).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from gemm_survey import resolve_246m  # noqa: E402

CONFIGS = [  # (label, dtype, PAGEDSERVE_LINEAR_METHOD)
    ("fp32 old (F.linear)", "float32", "torch"),
    ("fp32 auto", "float32", "auto"),
    ("bf16 auto", "bfloat16", "auto"),
    ("fp32 onednn (forced)", "float32", "onednn"),
    ("fp32 torch-t (forced)", "float32", "torch-t"),
    ("bf16 torch (forced)", "bfloat16", "torch"),
    ("bf16 onednn (forced)", "bfloat16", "onednn"),  # the bf16 rule before the AVX512-BF16 kernel
    ("bf16 cpp (forced)", "bfloat16", "cpp"),
]


def make_llm(path: Path, dtype: str, method: str, max_seqs: int, prompt_len: int, new_tokens: int):
    from pagedserve import LLM

    os.environ["PAGEDSERVE_LINEAR_METHOD"] = method
    return LLM(model=str(path), dtype=dtype, max_model_len=prompt_len + new_tokens + 64, max_num_seqs=max_seqs,
               max_num_batched_tokens=max(4096, prompt_len * max_seqs // 4), enable_prefix_caching=False,
               kv_cache_memory=4 * 2**30)


def generate(llm, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor(prompts)  # equal lengths: one batch, no padding
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    shares = []
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        shares.append(same / len(w))
    return sum(shares) / len(shares)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: $PEERS_DIR/small-llama, else a random 246M Llama")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--configs", default="0,1,2",
                    help="indices into " + "; ".join(f"{i}={c[0]}" for i, c in enumerate(CONFIGS)))
    ap.add_argument("--parity-prompts", type=int, default=16)
    ap.add_argument("--parity-tokens", type=int, default=32)
    args = ap.parse_args()
    path = resolve_246m(args.model_path)
    batches = [int(b) for b in args.batches.split(",")]
    configs = [CONFIGS[int(i)] for i in args.configs.split(",")]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(max(batches))]
    print(f"model {path}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")

    tok_s: dict[tuple[str, int], list[float]] = {}
    agree: dict[str, float] = {}
    hf_ref: dict[str, list[list[int]]] = {}
    parity_prompts = prompts[: args.parity_prompts] if args.parity_prompts <= len(prompts) else \
        [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.parity_prompts)]
    for rep in range(args.reps):
        for label, dtype, method in configs:
            llm = make_llm(path, dtype, method, max(batches), args.prompt_len, args.new_tokens)
            actual = llm.engine.dtype
            generate(llm, prompts[:1], 4)  # warm-up: oneDNN primitive creation, first-touch of the pool
            for bs in batches:
                seconds, _ = generate(llm, prompts[:bs], args.new_tokens)
                tok_s.setdefault((label, bs), []).append(bs * args.new_tokens / seconds)
                print(f"  rep {rep} {label:22} (computes in {actual}) bs={bs:3}: "
                      f"{bs * args.new_tokens / seconds:7.1f} tok/s  load {os.getloadavg()[0]:.2f}", flush=True)
            if rep == 0 and args.parity_prompts:
                _, got = generate(llm, parity_prompts, args.parity_tokens)
                if actual not in hf_ref:
                    llm = None  # free its weights before HF loads its own copy
                    gc.collect()
                    hf_ref[actual] = hf_greedy(path, parity_prompts, args.parity_tokens, getattr(torch, actual))
                agree[label] = agreement(got, hf_ref[actual])
                print(f"  {label}: greedy agreement with HF {actual}: {agree[label]:.3f}", flush=True)
            llm = None
            gc.collect()

    if {"float32", "bfloat16"} <= hf_ref.keys():  # how far bf16 rounding alone moves greedy decoding
        agree["HF bf16 vs HF fp32"] = agreement(hf_ref["bfloat16"], hf_ref["float32"])
        print(f"HF transformers bf16 vs fp32 greedy agreement: {agree['HF bf16 vs HF fp32']:.3f}")
    base = configs[0][0]
    print(f"\noutput tok/s, best of {args.reps} alternating runs; ratio vs {base}")
    print(f"{'config':24}" + "".join(f"{f'bs={bs}':>20}" for bs in batches) + f"{'HF agreement':>16}")
    for label, _, _ in configs:
        cells = []
        for bs in batches:
            best = max(tok_s[(label, bs)])
            cells.append(f"{f'{best:.1f} ({best / max(tok_s[(base, bs)]):.2f}x)':>20}")
        print(f"{label:24}" + "".join(cells) + f"{agree.get(label, float('nan')):>16.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    out = write_result("linear_methods", {"args": vars(args), "tok_s": {f"{k[0]}|{k[1]}": v for k, v in tok_s.items()},
                                          "agreement": agree})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
