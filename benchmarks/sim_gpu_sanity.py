"""GPU-scale sanity of `pagedserve simulate` with the stated default constants (no calibration).

1. H100-SXM, Llama-3.1-8B, one GPU, short chat (ShareGPT-like: ~128 in / ~192 out) at
   max concurrency 1, 16 and 64: predicted output tok/s, TPOT, TTFT.
2. Published vLLM measurements replayed in the simulator, side by side with the error:
   a. LambdaLabsML/vllm-benchmark, results/prompt_10/1xH100-80GB-SXM/
      Meta-Llama-3-8B-Instruct_tp1_len2048.json (vLLM v0.6, 2024-09-07): 10 ShareGPT
      prompts sent at once to one H100-SXM; Llama-3-8B has Llama-3.1-8B's exact shape.
      Its per-request input/output lengths are replayed below.
   b. johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100" (vLLM 0.23.0,
      Llama-3.1-8B-Instruct bf16, A100-40GB, random 1024 in / 128 out, ignore-eos):
      ~75 output tok/s at concurrency 1, and a 6.6x gain at concurrency 8.

    python benchmarks/sim_gpu_sanity.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench.workloads import WorkloadRequest, make_workload  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.sim.simulator import build_deployment, simulate  # noqa: E402

# (a) the replayed run's own per-request lengths and results
LAMBDA_INPUT = [13, 25, 27, 10, 329, 29, 399, 328, 4, 205]
LAMBDA_OUTPUT = [120, 429, 233, 194, 101, 741, 9, 3, 6, 31]
LAMBDA = {"output_throughput": 347.89, "median_tpot_ms": 7.56, "mean_ttft_ms": 62.43}


def deployment(gpu: str, max_num_seqs: int = 256):
    cfg = EngineConfig(max_num_seqs=max_num_seqs, gpu_memory_utilization=0.9, max_model_len=8192)
    return build_deployment(cfg, "llama-3.1-8b", gpu=gpu, tp=1)


def err(pred: float, ref: float) -> str:
    return f"{(pred - ref) / ref:+.0%}"


def main() -> int:
    out: dict = {}
    print("1. H100-SXM, Llama-3.1-8B bf16, TP 1, short chat (random 128 +-50% in, 192 +-50% out), default constants")
    print(f"{'concurrency':>12} {'out tok/s':>10} {'mean TPOT ms':>13} {'mean TTFT ms':>13} {'KV blocks':>10}")
    for c in (1, 16, 64):
        dep = deployment("H100-SXM")
        w = make_workload("random", max(8 * c, 40), seed=0, input_len=128, output_len=192, range_ratio=0.5,
                          vocab_size=128256)
        m = simulate(dep, w, max_concurrency=c).metrics
        out[f"h100_chat_c{c}"] = m
        print(f"{c:>12} {m['output_throughput']:>10.0f} {m['mean_tpot_ms']:>13.2f} {m['mean_ttft_ms']:>13.1f} "
              f"{dep.num_blocks:>10,}")

    print("\n2a. replay of LambdaLabsML/vllm-benchmark 1xH100-80GB-SXM Meta-Llama-3-8B-Instruct (10 prompts at once)")
    dep = deployment("H100-SXM")
    w = [WorkloadRequest([100] * p, None, p, o, 0.0) for p, o in zip(LAMBDA_INPUT, LAMBDA_OUTPUT)]
    m = simulate(dep, w).metrics
    out["lambda_h100_replay"] = m
    for key, label in (("output_throughput", "output tok/s"), ("median_tpot_ms", "median TPOT ms"),
                       ("mean_ttft_ms", "mean TTFT ms")):
        print(f"  {label:<16} published {LAMBDA[key]:>8.2f}   simulated {m[key]:>8.2f}   error {err(m[key], LAMBDA[key])}")

    print("\n2b. A100-40GB, Llama-3.1-8B, random 1024 in / 128 out, ignore-eos (johnmusgrave.com sweep)")
    tput = {}
    for c in (1, 8):
        dep = deployment("A100-40GB")
        w = make_workload("random", 20 * c, seed=0, input_len=1024, output_len=128, vocab_size=128256)
        m = simulate(dep, w, max_concurrency=c).metrics
        tput[c] = m["output_throughput"]
        out[f"a100_c{c}"] = m
    print(f"  C=1 output tok/s   published ~75      simulated {tput[1]:>6.1f}   error {err(tput[1], 75)}")
    print(f"  C=8 / C=1 gain     published 6.6x     simulated {tput[8] / tput[1]:>5.1f}x   "
          f"error {err(tput[8] / tput[1], 6.6)}")
    path = Path(__file__).resolve().parents[1] / "results" / "sim_gpu_sanity.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
