"""vLLM V1's engine core per step on this CPU, split into host work and the model's own compute.

    OMP_NUM_THREADS=1 /tmp/peers/vllm/bin/python benchmarks/vllm_engine_step_probe.py \
        [--model /tmp/serving-endpoint-probe/empty-model] [--out results/vllm_engine_step_probe.json]

Runs under vLLM's own venv (it imports vLLM only, never pagedserve). The LLM class with the engine
core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor: one thread does it all)
on a near-empty checkpoint (--load-format dummy; benchmarks/serving_endpoint_probe.py writes one: the
tiny checkpoint's config cut to one layer of hidden 128). Every engine step's thread CPU time
(time.thread_time, so the machine's load does not enter) is taken apart by wrapping, on the class:

* Scheduler.schedule and Scheduler.update_from_output (the scheduler's two halves),
* GPUModelRunner.execute_model and sample_tokens (the runner's step: state update, input
  preparation, forward, logits, sampler; the CPU runner inherits them),
* GPUModelRunner._model_forward and the model's compute_logits (the model's compute: on a GPU
  that is the device's work, so it is subtracted),
* the sampler module's forward (on a GPU, kernels; reported apart).

host per step = EngineCore.step - forward - logits - sampler: what a GPU host would still do per
step (schedule, the runner's Python and numpy input preparation, update), on this CPU. N requests
of 16 prompt tokens decode together for 36 tokens (ignore_eos); the per-step figures are medians
over the decode steps that held exactly N requests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

STREAMS = (1, 16, 64, 128)
OUTPUTS = 36

_acc: dict[str, float] = {}
_steps: list[dict] = []


def _wrap(cls, name: str, key: str):
    orig = getattr(cls, name)

    def inner(*a, **k):
        t0 = time.thread_time()
        try:
            return orig(*a, **k)
        finally:
            _acc[key] = _acc.get(key, 0.0) + time.thread_time() - t0

    setattr(cls, name, inner)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/serving-endpoint-probe/empty-model")
    ap.add_argument("--out", default="results/vllm_engine_step_probe.json")
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.model_executor.models.llama import LlamaForCausalLM

    for cls, name, key in ((Scheduler, "schedule", "schedule"), (Scheduler, "update_from_output", "update"),
                           (GPUModelRunner, "execute_model", "execute"), (GPUModelRunner, "sample_tokens", "sample_tokens"),
                           (GPUModelRunner, "_model_forward", "forward"), (LlamaForCausalLM, "compute_logits", "logits"),
                           (Sampler, "forward", "sampler")):
        _wrap(cls, name, key)
    step_orig = EngineCore.step

    def step(self):
        _acc.clear()
        n = len(self.scheduler.running)
        t0 = time.thread_time()
        out = step_orig(self)
        total = time.thread_time() - t0
        _steps.append({"running_before": n, "running_after": len(self.scheduler.running), "step": total, **_acc})
        return out

    EngineCore.step = step

    llm = LLM(model=args.model, load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=128,
              max_num_batched_tokens=4096, enable_prefix_caching=False, distributed_executor_backend="uni")
    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    llm.generate(["warm up the engine"] * 4, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    result = {}
    words = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()
    for n in args.streams:
        _steps.clear()
        prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 500 for j in range(16)]} for i in range(n)]
        llm.generate(prompts, SamplingParams(max_tokens=OUTPUTS, min_tokens=OUTPUTS, ignore_eos=True, temperature=0.0),
                     use_tqdm=False)
        dec = [s for s in _steps if s["running_before"] == n and s["running_after"] == n]
        if not dec:
            continue
        med = {k: statistics.median(s.get(k, 0.0) for s in dec)
               for k in ("step", "schedule", "update", "execute", "sample_tokens", "forward", "logits", "sampler")}
        host = statistics.median(s["step"] - s.get("forward", 0.0) - s.get("logits", 0.0) - s.get("sampler", 0.0)
                                 for s in dec)
        result[str(n)] = {"decode_steps": len(dec), "host_s": host, **{f"{k}_s": v for k, v in med.items()}}
        print(f"N={n:4d} ({len(dec)} steps): step {med['step'] * 1e3:.3f} ms = schedule {med['schedule'] * 1e3:.3f} + "
              f"update {med['update'] * 1e3:.3f} + runner {med['execute'] * 1e3 + med['sample_tokens'] * 1e3:.3f} "
              f"(forward {med['forward'] * 1e3:.3f}, logits {med['logits'] * 1e3:.3f}, sampler {med['sampler'] * 1e3:.3f})"
              f" -> host {host * 1e3:.3f} ms", flush=True)
    load1 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    out = {"vllm": vllm.__version__, "model": args.model, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_before": load0, "load_after": load1, "clock": "thread CPU time", "outputs": OUTPUTS,
           "by_streams": result}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"load {load0} -> {load1}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
