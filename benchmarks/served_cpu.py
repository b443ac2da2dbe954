"""Where a served token's time goes: CPU per output token of the API process and of the engine
core (per thread: each process's main thread and the rest), the core's busy share and its gaps
between steps while it had work, and SSE chunks per request, for `pagedserve serve` under the
peers' own load generator (bench_http.py) at several concurrencies; sides (checkouts and/or
environments) interleaved round by round, so their ratios come from one sitting.

    python benchmarks/served_cpu.py --model /tmp/peers/tiny-llama --conc 1,8,32 --rounds 2 \
        --side after=. --side before=/tmp/h32-before --side passive=.:OMP_WAIT_POLICY=PASSIVE

A side is NAME=CHECKOUT[:ENV=VALUE,...]: the server runs with PYTHONPATH=CHECKOUT and those
variables in its environment (the engine-core process inherits them). CPU times come from
/proc (utime + stime of every thread, the same clock that `top` reads), so they move less with
the other work on the machine than tok/s; the load average is printed beside each row.
`--profile` also samples the API process with py-spy during each run (only while a thread holds
the GIL: its Python work) and prints its hottest functions (own time, % of samples).

Columns: tok/s (bench_http's), chunks/req, API ms/tok (main thread + others), core ms/tok
(main thread + others: the OpenMP team and the socket threads), busy = the core's step time
over the time from its first step's start to its last step's end, gap = the mean time between two steps when the first left work
(the core's loop outside step(): messages in, outputs out, waiting on the GIL).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of `pid` (utime + stime)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def descendants(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in descendants(k)]


def engine_core_pid(api_pid: int) -> int | None:
    """The engine-core child: the descendant with the most threads (not the resource tracker)."""
    best, most = None, 0
    for pid in descendants(api_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            n = len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        if b"resource_tracker" not in cmd and n > most:
            best, most = pid, n
    return best


def split_cpu(before: dict[int, float], after: dict[int, float], main: int) -> tuple[float, float]:
    """(main thread, all other threads) CPU seconds spent between two snapshots."""
    spent = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
    return spent.get(main, 0.0), sum(v for tid, v in spent.items() if tid != main)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                return json.load(r)["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not start")


def bench_http(peers: Path, port: int, name: str, conc: int, new_tokens: int, prompt_len: int) -> dict:
    out = subprocess.run([sys.executable, str(peers / "bench_http.py"), "--port", str(port), "--model", name,
                          "--conc", str(conc), "--requests", str(conc), "--prompt-len", str(prompt_len),
                          "--max-tokens", str(new_tokens), "--flavor", "vllm"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def py_spy_top(pid: int, seconds: float, path: Path) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", "1000", "--gil", "--format", "raw", "--output", str(path), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def hottest(path: Path, top: int = 8) -> list[tuple[str, float]]:
    """Own-time share of each leaf function in py-spy's collapsed stacks."""
    own: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        own[leaf.split(" (")[0] + " " + leaf.rsplit("/", 1)[-1].rstrip(")")] += int(count)
        total += int(count)
    return [(f, 100.0 * c / total) for f, c in own.most_common(top)] if total else []


def step_stats(trace: Path, t0: float, t1: float) -> dict:
    """The core's steps that ended inside [t0, t1] (monotonic): busy share and gaps with work."""
    steps = []
    if trace.exists():
        for line in trace.read_text().splitlines():
            s = json.loads(line)
            if t0 <= s["t_end"] <= t1:
                steps.append(s)
    gaps = [b["t_end"] - b["step_time"] - a["t_end"] for a, b in zip(steps, steps[1:]) if a["num_unfinished"] > 0]
    span = steps[-1]["t_end"] - steps[0]["t_end"] + steps[0]["step_time"] if steps else 0.0  # first step to last
    return {"steps": len(steps), "busy": sum(s["step_time"] for s in steps) / max(span, 1e-9),
            "step_ms": 1e3 * statistics.mean([s["step_time"] for s in steps]) if steps else 0.0,
            "gap_ms": 1e3 * statistics.mean(gaps) if gaps else 0.0}


def run_side(name: str, root: Path, env_extra: dict, args, workdir: Path) -> dict[int, dict]:
    port = free_port()
    trace = workdir / f"{name}-{time.monotonic_ns()}.jsonl"
    env = {**os.environ, "PYTHONPATH": str(root), **env_extra}
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-model-len", "512", "--max-num-seqs", "32", "--no-enable-prefix-caching",
           "--kv-cache-memory", "2GiB", "--step-trace-path", str(trace), *args.serve_args]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    try:
        model = wait_ready(port, proc)
        core = engine_core_pid(proc.pid)
        bench_http(args.peers, port, model, 1, 8, args.prompt_len)  # warm-up
        for conc in args.conc:
            api0, core0 = thread_cpu(proc.pid), thread_cpu(core) if core else {}
            spy = py_spy_top(proc.pid, 600, workdir / "spy.txt") if args.profile else None
            m0 = time.monotonic()
            r = bench_http(args.peers, port, model, conc, args.new_tokens, args.prompt_len)
            m1 = time.monotonic()
            api1, core1 = thread_cpu(proc.pid), thread_cpu(core) if core else {}
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            ntok = max(1, r["out_tokens"])
            api_main, api_rest = split_cpu(api0, api1, proc.pid)
            core_main, core_rest = split_cpu(core0, core1, core) if core else (0.0, 0.0)
            results[conc] = {"tok_s": r["out_tok_s"], "chunks": r["chunks_per_req"], "errors": r["errors"],
                             "api_main": 1e3 * api_main / ntok, "api_rest": 1e3 * api_rest / ntok,
                             "core_main": 1e3 * core_main / ntok, "core_rest": 1e3 * core_rest / ntok,
                             "load": os.getloadavg()[0], **step_stats(trace, m0, m1),
                             "hot": hottest(workdir / "spy.txt") if args.profile else []}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return results


def parse_side(spec: str) -> tuple[str, Path, dict]:
    name, _, rest = spec.partition("=")
    root, _, envs = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
    return name, Path(root).resolve(), env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/peers/tiny-llama")
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--side", action="append", help="NAME=CHECKOUT[:ENV=VALUE,...] (default: this=.)")
    ap.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_SCRIPTS", HERE.parent.parent / "shared/peers")))
    ap.add_argument("--profile", action="store_true", help="py-spy the API process: its hottest functions")
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    ap.add_argument("serve_args", nargs="*", help="after --: more `pagedserve serve` flags")
    args = ap.parse_args()
    args.conc = [int(c) for c in args.conc.split(",")]
    if not (args.peers / "bench_http.py").exists():
        args.peers = Path("/work/shared/peers")
    sides = [parse_side(s) for s in (args.side or [f"this={HERE.parent}"])]
    workdir = Path(tempfile.mkdtemp(prefix="ps-served-cpu-"))
    rows: list[dict] = []
    for rnd in range(args.rounds):
        order = sides if rnd % 2 == 0 else sides[::-1]  # alternate who goes first
        for name, root, env in order:
            for conc, r in run_side(name, root, env, args, workdir).items():
                rows.append({"round": rnd, "side": name, "conc": conc, **r})
                print(f"round {rnd} {name:10} conc {conc:3}  {r['tok_s']:7.1f} tok/s  chunks/req {r['chunks']:6.1f}  "
                      f"API {r['api_main']:.3f}+{r['api_rest']:.3f} ms/tok  core {r['core_main']:.3f}+"
                      f"{r['core_rest']:.3f} ms/tok  busy {r['busy']:.2f}  step {r['step_ms']:.2f} ms  "
                      f"gap {r['gap_ms']:.3f} ms  load {r['load']:.2f}", flush=True)
                for f, pct in r["hot"]:
                    print(f"      {pct:5.1f}%  {f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\nmedians over rounds        tok/s  chunks  API ms/tok  core ms/tok   busy  gap ms   load")
    for conc in args.conc:
        for name, _, _ in sides:
            rs = [r for r in rows if r["side"] == name and r["conc"] == conc]
            med = lambda k: statistics.median(r[k] for r in rs)
            print(f"{name:10} conc {conc:3}  {med('tok_s'):10.1f} {med('chunks'):7.1f} "
                  f"{statistics.median(r['api_main'] + r['api_rest'] for r in rs):11.3f} "
                  f"{statistics.median(r['core_main'] + r['core_rest'] for r in rs):12.3f} {med('busy'):6.2f} "
                  f"{med('gap_ms'):7.3f} {med('load'):6.2f}")


if __name__ == "__main__":
    main()
