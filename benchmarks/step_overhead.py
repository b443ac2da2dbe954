"""Per-step CPU time of the engine outside the model, against output length.

    python benchmarks/step_overhead.py                     # 16 sequences x 4,000 tokens
    python benchmarks/step_overhead.py --seqs 16 --tokens 2000

The model is replaced by an executor that samples a random token at once, so what is timed
is the engine's own work per step: schedule, update, outputs, detokenization and stop
strings (the built-in model's tokenizer). A step whose cost grows with the output length
(copying each request's whole output every step) shows as a rising column; a bounded
output path is flat. Prints the mean step time in windows of output length, and the
ratio of the last window to the first.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from pagedserve.sim.instant_executor import InstantExecutor


def model_dir_with_room(max_len: int) -> Path:
    """The built-in model's config and tokenizer, with a longer max_position_embeddings."""
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR

    tmp = Path(tempfile.mkdtemp(prefix="ps-step-overhead-"))
    for f in Path(DEFAULT_MODEL_DIR).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp / f.name)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["max_position_embeddings"] = max_len
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--stop", action="store_true", help="give every request a stop string (never matched)")
    args = ap.parse_args()

    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.engine import Engine

    prompt_len = 32
    model = model_dir_with_room(prompt_len + args.tokens + 64)
    engine = Engine(EngineConfig(model=str(model), max_num_seqs=args.seqs, num_kv_blocks=args.seqs * 300,
                                 max_model_len=prompt_len + args.tokens + 64, enable_prefix_caching=False,
                                 preemption_mode="recompute"), executor=InstantExecutor(4096))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0,
                            stop=["\x00never\x00"] if args.stop else None)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", [rng.randrange(16, 4096) for _ in range(prompt_len)], params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    shutil.rmtree(model, ignore_errors=True)
    # Step 0 is the prefill; the decode steps follow, one output token each.
    decode = times[1:]
    per = len(decode) // args.windows
    print(f"{args.seqs} sequences x {args.tokens} output tokens: mean engine step time (ms) by output length")
    means = []
    for w in range(args.windows):
        chunk = decode[w * per:(w + 1) * per]
        means.append(sum(chunk) / len(chunk) * 1e3)
        print(f"  tokens {w * per + 1:>5}-{(w + 1) * per:>5}: {means[-1]:7.3f} ms")
    print(f"last window / first window: {means[-1] / means[0]:.2f}x")


if __name__ == "__main__":
    main()
