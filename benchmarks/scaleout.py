"""Scaling out, measured side by side in one run:

1. wire: what one step costs to encode + decode, msgspec Structs vs pickle (EngineCoreOutputs
   of 32 decodes; a SchedulerOutput of 32 decodes, the per-step TP broadcast)
2. served output tok/s at concurrency 1 / 8 / 32, engine core in a thread vs in its own
   process, and offline LLM.generate on the same requests (the peers' HTTP workload:
   128-token prompts of random ids, 128 new tokens, greedy, ignore_eos)
3. tensor parallelism: tp=1 (in process) vs tp=1 (one mp worker) vs tp=2 (two mp workers)
   offline, with the broadcast and all-reduce share of step time

    python benchmarks/scaleout.py [--model /tmp/peers/small-llama] [--parts wire,served,tp]

The model: --model, else the 246M peer checkpoint at /tmp/peers/small-llama if present,
else a 100M random Llama (common.benchmark_checkpoint). Results: results/scaleout.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, benchmark_checkpoint, param_count, write_result

PEER_MODEL = Path("/tmp/peers/small-llama")
PEER_BENCH = Path("/work/shared/peers/bench_http.py")
PROMPT_LEN, NEW_TOKENS = 128, 128


def pick_model(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return PEER_MODEL if (PEER_MODEL / "config.json").exists() else benchmark_checkpoint("100m")


# -- 1. wire --------------------------------------------------------------------------
def bench_wire(n: int = 3000) -> dict:
    import msgspec

    from pagedserve.core.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats, TokenLogprobs
    from pagedserve.core.scheduler import ScheduledRequest, SchedulerOutput

    outs = EngineCoreOutputs([EngineCoreOutput(f"cmpl-{i:032x}", [1000 + i],
                                               [TokenLogprobs(1000 + i, -0.5, 1, [(1000 + i, -0.5), (7, -2.0)])]
                                               if i % 4 == 0 else None) for i in range(32)],
                             SchedulerStats(num_batched_tokens=32, num_running=32, num_preempted={"swap": 0}),
                             123.0, 0.05, 0.049, 0.048)
    sched = SchedulerOutput([ScheduledRequest(f"cmpl-{i:032x}", 300 + i, [1000 + i], [77] if i % 16 == 0 else [],
                                              False, True) for i in range(32)], 32)
    enc = msgspec.msgpack.Encoder()
    result = {}
    for name, obj, typ in (("EngineCoreOutputs(32 decodes)", outs, EngineCoreOutputs),
                           ("SchedulerOutput(32 decodes)", sched, SchedulerOutput)):
        dec = msgspec.msgpack.Decoder(typ)
        t0 = time.perf_counter()
        for _ in range(n):
            dec.decode(enc.encode(obj))
        t_msgspec = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n):
            pickle.loads(pickle.dumps(obj))
        t_pickle = (time.perf_counter() - t0) / n
        result[name] = {"msgspec_us": t_msgspec * 1e6, "pickle_us": t_pickle * 1e6,
                        "msgspec_bytes": len(enc.encode(obj)), "pickle_bytes": len(pickle.dumps(obj)),
                        "speedup": t_pickle / t_msgspec}
    print("\n## wire: encode + decode of one step (us)")
    print(f"{'message':32}{'msgspec':>10}{'pickle':>10}{'ratio':>8}{'bytes msgspec/pickle':>24}")
    for name, r in result.items():
        print(f"{name:32}{r['msgspec_us']:>10.1f}{r['pickle_us']:>10.1f}{r['speedup']:>7.1f}x"
              f"{r['msgspec_bytes']:>12}/{r['pickle_bytes']}")
    return result


# -- 2. served: thread vs process vs LLM.generate --------------------------------------
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`pagedserve serve` in a subprocess (log in results/), stopped with SIGTERM."""

    def __init__(self, model: Path, mode: str, engine_flags: list[str]) -> None:
        import httpx

        self.mode = mode
        self.port = free_port()
        log = open(ROOT / "results" / f"scaleout_serve_{mode}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model),
                                      "--port", str(self.port), "--engine-core-mode", mode, "--log-interval", "0",
                                      "--uvicorn-log-level", "warning", *engine_flags],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {mode} server died at start-up; see results/scaleout_serve_{mode}.log")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.name = httpx.get(f"http://127.0.0.1:{self.port}/v1/models").json()["data"][0]["id"]
        self.vocab = json.loads((model / "config.json").read_text())["vocab_size"]

    def bench(self, conc: int, new_tokens: int) -> dict:
        common = [sys.executable, str(PEER_BENCH), "--port", str(self.port), "--model", self.name,
                  "--vocab", str(self.vocab), "--flavor", "vllm", "--prompt-len", str(PROMPT_LEN)]
        out = subprocess.run(common + ["--conc", str(conc), "--requests", str(conc), "--max-tokens", str(new_tokens),
                                       "--label", self.mode], check=True, capture_output=True, text=True, timeout=3600)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Offline:
    """LLM.generate on the HTTP bench's prompts (seeded random ids in [3, vocab))."""

    def __init__(self, model: Path, engine_args: dict) -> None:
        from pagedserve import LLM

        self.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        self.llm = LLM(str(model), **engine_args)

    def bench(self, conc: int, new_tokens: int) -> dict:
        import random

        from pagedserve import SamplingParams

        rng = random.Random(0)
        prompts = [[rng.randrange(3, self.vocab) for _ in range(PROMPT_LEN)] for _ in range(conc)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, min_tokens=new_tokens)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"out_tokens": ntok, "wall_s": wall, "out_tok_s": ntok / wall}

    def stop(self) -> None:
        self.llm.shutdown()


def bench_served(model: Path, concs: list[int], new_tokens: int, engine_args: dict) -> dict:
    """All three loaded at once, idle but one; at each concurrency they run one after the
    other, so a change in the machine's load hits all three alike."""
    flags = []
    for k, v in engine_args.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    print(f"\n## served output tok/s, {PROMPT_LEN}-token prompts, {new_tokens} new tokens ({model.name})", flush=True)
    runners = {"thread": Served(model, "thread", flags), "process": Served(model, "process", flags),
               "generate": Offline(model, engine_args)}
    res: dict = {name: {} for name in runners}
    try:
        for name, runner in runners.items():  # warm-up
            runner.bench(1, 4)
        for c in concs:
            for name, runner in runners.items():
                res[name][c] = r = runner.bench(c, new_tokens)
                print(f"  {name:8} conc {c:>3}: {r['out_tok_s']:8.1f} out tok/s"
                      + (f" (errors {r['errors']}, ttft {r['ttft_mean_s']} s)" if "errors" in r else ""), flush=True)
    finally:
        for runner in runners.values():
            runner.stop()
    print(f"{'conc':>6}{'thread':>10}{'process':>10}{'generate':>10}{'process/thread':>16}{'thread/generate':>17}")
    for c in concs:
        t, p, g = (res[k][c]["out_tok_s"] for k in ("thread", "process", "generate"))
        print(f"{c:>6}{t:>10.1f}{p:>10.1f}{g:>10.1f}{p / t:>15.2f}x{t / g:>16.2f}x")
    return res


# -- 3. tensor parallelism ------------------------------------------------------------
def bench_tp(model: Path, num_seqs: int, new_tokens: int, engine_args: dict) -> dict:
    import random

    from pagedserve import LLM, SamplingParams

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(num_seqs)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    print(f"\n## tensor parallelism, LLM.generate: {num_seqs} x ({PROMPT_LEN} prompt + {new_tokens} new), "
          f"{os.cpu_count()} cores")
    res = {}
    for label, extra in (("tp1 in-process", dict(tensor_parallel_size=1)),
                         ("tp1 mp worker", dict(tensor_parallel_size=1, distributed_executor_backend="mp")),
                         ("tp2 mp workers", dict(tensor_parallel_size=2))):
        llm = LLM(str(model), **engine_args, **extra)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        ex = llm.engine.executor
        if hasattr(ex, "reset_stats"):
            ex.set_comm_observer(True)  # the ranks time their collectives only when asked
            ex.reset_stats()
        core = llm.engine.engine_core
        step_time = {"sum": 0.0}
        original_step = core.step

        def timed_step():
            out = original_step()
            step_time["sum"] += out.step_time
            return out

        core.step = timed_step
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"wall_s": wall, "out_tok_s": ntok / wall, "step_seconds": step_time["sum"],
               "tokens": [o.outputs[0].token_ids for o in outs]}
        if hasattr(ex, "worker_stats"):
            stats = ex.worker_stats()
            rank0 = stats[0]
            row.update(broadcasts=ex.num_broadcasts, broadcast_seconds=ex.broadcast_seconds,
                       broadcast_bytes_per_step=ex.broadcast_bytes / max(ex.num_broadcasts, 1),
                       rank0_decode_seconds=rank0["decode_seconds"], rank0_execute_seconds=rank0["execute_seconds"],
                       rank0_all_reduce_seconds=rank0["all_reduce"], rank0_gather_seconds=rank0["gather"],
                       rank0_collectives=rank0["calls"])
        llm.shutdown()
        res[label] = row
    base = res["tp1 in-process"]
    print(f"{'':18}{'out tok/s':>10}{'vs tp1':>8}{'broadcast':>11}{'all-reduce':>12}{'B/step':>8}")
    for label, r in res.items():
        if "broadcast_seconds" in r:
            bshare = (r["broadcast_seconds"] + r["rank0_decode_seconds"]) / r["step_seconds"]
            ashare = (r["rank0_all_reduce_seconds"] + r["rank0_gather_seconds"]) / r["step_seconds"]
            extra = f"{bshare:>10.1%}{ashare:>12.1%}{r['broadcast_bytes_per_step']:>8.0f}"
        else:
            extra = f"{'-':>10}{'-':>12}{'-':>8}"
        print(f"{label:18}{r['out_tok_s']:>10.1f}{r['out_tok_s'] / base['out_tok_s']:>7.2f}x{extra}")
    same = res["tp2 mp workers"]["tokens"] == base["tokens"]
    print(f"(shares are of the engine core's summed step time; tp2 greedy tokens identical to tp1: {same})")
    for r in res.values():
        r.pop("tokens")
    res["tp2_tokens_identical"] = same
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--parts", default="wire,served,tp")
    ap.add_argument("--concs", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--tp-seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for every engine (OMP_NUM_THREADS for the servers and ranks); "
                         "default: torch's own choice")
    args = ap.parse_args()
    if args.threads:
        import torch
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers and mp ranks inherit it
        torch.set_num_threads(args.threads)
    (ROOT / "results").mkdir(exist_ok=True)
    model = pick_model(args.model)
    parts = args.parts.split(",")
    engine_args = dict(kv_cache_memory="2GiB", max_model_len=1024, max_num_seqs=64)
    result = {"model": str(model), "params": param_count(model), "cores": os.cpu_count(), "threads": args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"model {model} ({param_count(model) / 1e6:.0f}M parameters), {os.cpu_count()} cores, "
          f"torch threads per engine/rank: {args.threads or 'default'}")
    if "wire" in parts:
        result["wire"] = bench_wire()
    if "served" in parts:
        result["served"] = bench_served(model, [int(c) for c in args.concs.split(",")], args.new_tokens, engine_args)
    if "tp" in parts:
        result["tp"] = bench_tp(model, args.tp_seqs, args.new_tokens, engine_args)
    print(f"wrote {write_result('scaleout', result)}")


if __name__ == "__main__":
    main()
