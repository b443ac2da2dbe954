"""Mixed steps against the engine's own step traces on CPU: is a prompt chunk beside decodes priced right?

    OMP_NUM_THREADS=1 python benchmarks/mixed_steps.py [--size 20m] [--steps 12]

The real engine (in-process, one torch thread, --step-trace-path) runs a grid of step mixes:
B requests decoding (1, 4, 8, 16) while a prompt of C tokens (0, 32, 128, 256) arrives before
every step, so each traced step holds C chunk tokens beside B decodes, at growing contexts. The
cost model is fitted (`simulate calibrate`'s fit, on the engine thread's CPU time) on one half of
the steps (every other step of every cell) and predicts the other half; the table gives the
held-out error per cell, so a term that misprices the mix shows as a bias that moves with C at
fixed B. On a CPU the compute and memory parts add ("sum"); the GPU presets' per-kind roofline
(sim/cost_model.py, CostModel.breakdown) is checked by hand in tests/test_sim_truth.py.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import benchmark_checkpoint  # noqa: E402

BATCHES = (1, 4, 8, 16)
CHUNKS = (0, 32, 128, 256)


def run_grid(model: Path, trace: Path, steps: int, seed: int = 0) -> None:
    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.engine import Engine

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    engine = Engine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=32, max_num_batched_tokens=512,
                                 max_model_len=1024, kv_cache_memory="1GiB", enable_prefix_caching=False,
                                 step_trace_path=str(trace)))
    k = 0
    for batch in BATCHES:
        for chunk in CHUNKS:
            for _ in range(batch):
                engine.add_request(f"d{k}", [rng.randrange(16, vocab) for _ in range(rng.randint(16, 400))],
                                   SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0))
                k += 1
            engine.step()  # the decoders' prompts
            for _ in range(steps):
                if chunk:  # a prompt of one chunk arrives before every step, beside the decodes
                    engine.add_request(f"p{k}", [rng.randrange(16, vocab) for _ in range(chunk)],
                                       SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
                    k += 1
                engine.step()
            while engine.has_unfinished_requests():
                engine.step()
    if hasattr(engine, "shutdown"):
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=12, help="decode steps per cell")
    args = ap.parse_args()

    from pagedserve.plan.models import load_model
    from pagedserve.sim.cost_model import CPU_NOMINAL_BANDWIDTH, CPU_NOMINAL_FLOPS, CostModel, CostParams, ModelCost, \
        fit, read_trace

    model = benchmark_checkpoint(args.size)
    with tempfile.TemporaryDirectory(prefix="ps-mixed-") as tmp:
        trace = Path(tmp) / "steps.jsonl"
        run_grid(model, trace, args.steps)
        records = [r for r in read_trace(trace) if r.num_reqs]
    info = load_model(str(model))
    m = ModelCost.from_shape(info.shape, "float32", None, 1)
    base = CostParams(peak_flops=CPU_NOMINAL_FLOPS, mem_bandwidth=CPU_NOMINAL_BANDWIDTH, combine="sum")
    train, test = records[0::2], records[1::2]
    params, report = fit(train, m, base, fit_pad_share=True, host_bandwidth_fallback=(1e10, "unused"))
    cm = CostModel(m, params)
    # held-out: the engine thread's CPU time (what the shape was fitted to), scaled like the fit
    scale = report["wall_per_cpu"] or 1.0
    cells: dict[tuple[int, int], list[float]] = {}
    for r in test:
        decodes = sum(1 for n in r.new_tokens if n == 1)
        chunk = sum(n for n in r.new_tokens if n > 1)
        b = min(BATCHES, key=lambda x: abs(x - decodes))
        c = min(CHUNKS, key=lambda x: abs(x - chunk))
        pred = cm.predict(r.new_tokens, r.context_lens, 0, r.num_outputs) - params.per_output_overhead_s * r.num_outputs
        cells.setdefault((b, c), []).append(pred / scale / max(r.cpu_time, 1e-6) - 1)
    print(f"{len(records)} steps traced; fitted on {len(train)}, held out {len(test)}; "
          f"fit mean |error| {report['mean_abs_rel_error']:.1%}")
    print("held-out median error of the predicted step CPU time, by decodes (rows) x chunk tokens (columns)")
    print("| decodes | " + " | ".join(f"chunk {c}" for c in CHUNKS) + " |")
    print("|---|" + "---:|" * len(CHUNKS))
    for b in BATCHES:
        row = []
        for c in CHUNKS:
            errs = cells.get((b, c))
            row.append(f"{statistics.median(errs):+.1%} (n={len(errs)})" if errs else "-")
        print(f"| {b} | " + " | ".join(row) + " |")
    mixed = [e for (b, c), v in cells.items() if c for e in v]
    pure = [e for (b, c), v in cells.items() if not c for e in v]
    print(f"median |error|: steps with a chunk {statistics.median(abs(e) for e in mixed):.1%} ({len(mixed)}), "
          f"decode-only {statistics.median(abs(e) for e in pure):.1%} ({len(pure)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
