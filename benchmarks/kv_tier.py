"""The host KV tier (--kv-offloading-size) on vs off, side by side in one run.

Two workloads through an in-process Engine, wall clock:
- multi-turn: conversations whose history outgrows what the pool keeps across turns. Each
  conversation is closed-loop (its next turn is sent when its answer is complete: the
  previous prompt + the answer + a new question), all of them in flight at once, so between
  two turns of one conversation the others' prefills evict its history. Reported: the
  working-set / pool ratio, TTFT P50/P99, prompt tokens computed, the tier's hit rate, output
  throughput.
- with --disk-gib, a third row: a small host tier (--disk-host-gib) over a disk tier
  (--kv-offloading-disk in a fresh temporary directory), so the history goes pool -> host ->
  disk and comes back through the host tier.
- no reuse: the same number of requests and lengths with unrelated random prompts (nothing
  to hit), the tier's overhead on output throughput (goal <= 3%).

    python benchmarks/kv_tier.py                    # 20M random Llama
    python benchmarks/kv_tier.py --size 100m --reps 2
    python benchmarks/kv_tier.py --disk-gib 1       # + the host+disk row

Timing numbers come from a machine other processes share: read the ratios of the rows
measured in the same run, not the absolute values.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time

from common import benchmark_checkpoint, percentile, print_side_by_side, write_result
from pagedserve.engine import Engine
from pagedserve.config import EngineConfig
from pagedserve.engine.output_processor import OutputKind
from pagedserve.sampling import SamplingParams


def conversations(args, vocab: int, reuse: bool, seed: int) -> list[list[list[int]]]:
    """Per conversation, its turns' new tokens (the first: the opening prompt). Without reuse
    every request is its own opening prompt of the same length the multi-turn one reaches."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(16, vocab) for _ in range(n)]
    return [[tok(args.first_len)] + [tok(args.turn_len) for _ in range(args.turns - 1)]
            for _ in range(args.conversations)]


def run(engine: Engine, convs: list[list[list[int]]], args, reuse: bool) -> dict:
    """All conversations in flight at once, each closed-loop. Returns per-request records."""
    sched = engine.engine_core.scheduler
    schedule = sched.schedule
    counted = {"prefill": 0, "tier_hits": 0, "tier_queries": 0}

    def counting_schedule():
        out = schedule()
        counted["prefill"] += out.stats.num_prefill_tokens
        counted["tier_hits"] += out.stats.tier_hits
        counted["tier_queries"] += out.stats.tier_queries
        return out
    sched.schedule = counting_schedule
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    history = [[] for _ in convs]
    turn = [0] * len(convs)
    sent: dict[str, tuple[int, float]] = {}
    records = []
    n = 0
    t0, c0 = time.perf_counter(), time.thread_time()

    def send(c: int) -> None:
        nonlocal n
        history[c] = (history[c] if reuse else []) + convs[c][turn[c]]
        rid = f"c{c}t{turn[c]}r{n}"
        n += 1
        engine.add_request(rid, list(history[c]), params, output_kind=OutputKind.DELTA)
        sent[rid] = (c, time.perf_counter())

    for c in range(len(convs)):
        send(c)
    first: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            answers.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                c, at = sent.pop(out.request_id)
                records.append({"prompt_len": len(history[c]), "ttft": first[out.request_id] - at, "e2el": now - at,
                                "output_len": len(answers[out.request_id])})
                history[c] = history[c] + answers.pop(out.request_id)
                turn[c] += 1
                if turn[c] < len(convs[c]):
                    send(c)
    duration, cpu = time.perf_counter() - t0, time.thread_time() - c0
    sched.schedule = schedule
    ttft = [r["ttft"] * 1e3 for r in records]
    prompt = sum(r["prompt_len"] for r in records)
    out_tokens = sum(r["output_len"] for r in records)
    tier = sched.kv.tier
    return {
        "requests": len(records), "duration_s": duration,
        "p50_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
        "prompt_tokens": prompt, "prompt_tokens_computed": counted["prefill"],  # recomputed ones included
        "prefix_hit_rate": sched.kv.prefix_hits / max(sched.kv.prefix_queries, 1),
        "tier_hit_rate": counted["tier_hits"] / max(counted["tier_queries"], 1),
        "tier_blocks_loaded": tier.counters.loaded if tier is not None else 0,
        "tier_blocks_stored": tier.counters.stored if tier is not None else 0,
        "disk_blocks_stored": tier.disk.counters.stored if tier is not None and tier.disk is not None else 0,
        "disk_blocks_loaded": tier.disk.counters.loaded if tier is not None and tier.disk is not None else 0,
        "output_throughput": out_tokens / duration,
        # This thread's CPU seconds (torch runs in it with OMP_NUM_THREADS=1): what the work cost,
        # less exposed than the wall clock to the other processes sharing the machine.
        "engine_cpu_s": cpu,
        "preemptions": sched.total_preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="20m")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", type=int, default=512, help="opening prompt tokens")
    ap.add_argument("--turn-len", type=int, default=64, help="new tokens per later turn (after the answer)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--pool-tokens", type=int, default=2048, help="the device pool, in tokens")
    ap.add_argument("--tier-gib", type=float, default=0.25, help="--kv-offloading-size for the 'tier on' runs")
    ap.add_argument("--disk-gib", type=float, default=0.0,
                    help="> 0: a third row, a small host tier (--disk-host-gib) over a disk tier of this many GiB")
    ap.add_argument("--disk-host-gib", type=float, default=0.02, help="--kv-offloading-size for the disk row")
    ap.add_argument("--disk-path", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1,
                    help="alternate on/off this many times; the run with the least engine CPU time is kept")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = benchmark_checkpoint(args.size)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    final_len = args.first_len + (args.turns - 1) * (args.output_len + args.turn_len)
    max_model_len = final_len + args.output_len + 16
    working_set = args.conversations * final_len
    results, raw = {}, {}
    rows = [("tier off", None, False), ("tier on", args.tier_gib, False)]
    if args.disk_gib > 0:
        rows.append(("host+disk", args.disk_host_gib, True))
    names = [name for name, _, _ in rows]
    for workload, reuse in (("multi-turn", True), ("no reuse", False)):
        convs = conversations(args, vocab, reuse, args.seed)
        if not reuse:  # each request as long as the multi-turn ones are on average
            rng = random.Random(args.seed + 1)
            mean_len = args.first_len + (args.turns - 1) * (args.output_len + args.turn_len) // 2
            convs = [[[rng.randrange(16, vocab) for _ in range(mean_len)] for _ in range(args.turns)]
                     for _ in range(args.conversations)]
        for rep in range(args.reps):
            for name, size, disk in rows:
                disk_knobs = {}
                if disk:  # a fresh directory per run: each starts cold, as the others do
                    disk_knobs = dict(kv_offloading_disk=tempfile.mkdtemp(dir=args.disk_path),
                                      kv_offloading_disk_size=args.disk_gib)
                config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=args.pool_tokens // 16,
                                      max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=max(512, args.max_num_seqs), kv_offloading_size=size,
                                      swap_space="256MiB", **disk_knobs)
                engine = Engine(config)
                got = run(engine, convs, args, reuse)
                engine.shutdown()
                if disk:
                    shutil.rmtree(disk_knobs["kv_offloading_disk"], ignore_errors=True)
                raw.setdefault(f"{workload}: {name}", []).append(got)
                key = f"{workload}: {name}"
                if key not in results or got["engine_cpu_s"] < results[key]["engine_cpu_s"]:
                    results[key] = got
    ratio = working_set / args.pool_tokens
    print(f"model {args.size}; {args.conversations} conversations x {args.turns} turns (opening {args.first_len}, "
          f"+{args.output_len} answer +{args.turn_len} question per turn), all in flight, max_num_seqs "
          f"{args.max_num_seqs}; pool {args.pool_tokens} tokens, working set {working_set} tokens = {ratio:.1f}x "
          f"the pool; tier {args.tier_gib} GiB; best of {args.reps}; shared machine (other processes running)")
    keys = ["p50_ttft_ms", "p99_ttft_ms", "prompt_tokens", "prompt_tokens_computed", "prefix_hit_rate",
            "tier_hit_rate", "tier_blocks_stored", "tier_blocks_loaded"] + (
            ["disk_blocks_stored", "disk_blocks_loaded"] if args.disk_gib > 0 else []) + ["output_throughput", "engine_cpu_s",
            "preemptions"]
    for workload in ("multi-turn", "no reuse"):
        print_side_by_side(f"\n{workload}", {n: results[f"{workload}: {n}"] for n in names}, keys,
                           ratio_of=("tier on", "tier off"))
    on, off = results["no reuse: tier on"], results["no reuse: tier off"]
    overhead = 1 - on["output_throughput"] / off["output_throughput"]
    cpu_overhead = on["engine_cpu_s"] / off["engine_cpu_s"] - 1
    print(f"\nno-reuse overhead of the tier (goal <= 3%): output throughput {100 * overhead:+.1f}%, "
          f"engine CPU seconds {100 * cpu_overhead:+.1f}% (best of {args.reps} each)")
    for key, runs in raw.items():
        print(f"  {key}: output tok/s per run " + ", ".join(f"{r['output_throughput']:.2f}" for r in runs)
              + "; CPU s per run " + ", ".join(f"{r['engine_cpu_s']:.1f}" for r in runs))
    print(f"wrote {write_result('kv_tier', {'args': vars(args), 'working_set_over_pool': ratio, 'results': results, 'runs': raw})}")


if __name__ == "__main__":
    main()
