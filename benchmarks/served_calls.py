"""The served path's work per streamed token, counted rather than timed: every Python call and
C call (torch ops included) in all the server's threads (uvicorn's loop, the engine thread) while
a burst of CONC streams of NEW tokens is served, for this checkout and, with --before, another one.

    python benchmarks/served_calls.py --model /tmp/pagedserve-bench/llama-19m --before /tmp/before

Counts move little with the machine's load, where tok/s at 8 streams on 2 shared cores moves by
20%: a served slowdown that counts do not show is not more work in the process (look at threads,
the machine, the kernels' own time). The burst is admitted at once (the engine is paused until
every request is waiting), greedy, EOS ignored, 128-token prompts, prefix caching off, the
dashboard and the stats log off (their periodic work follows the clock, not the tokens). Prints
calls per token per side, torch ops per token, and the functions whose counts differ most.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def child(args) -> None:
    counts: collections.Counter = collections.Counter()
    on = [False]

    def prof(frame, event, arg):
        if not on[0]:
            return
        if event == "call":
            code = frame.f_code
            path = code.co_filename.split("site-packages/")[-1].split("pagedserve/", 1)[-1]
            counts[f"{path}:{code.co_name}"] += 1
        elif event == "c_call":
            counts["C:" + getattr(arg, "__qualname__", repr(arg))] += 1

    threading.setprofile(prof)  # every thread started from here on: uvicorn's and the engine's
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server

    config = EngineConfig(model=args.model, max_model_len=512, max_num_seqs=32, enable_prefix_caching=False,
                          kv_cache_memory="256MiB")
    app, engine = build_server(config, engine_core_mode="thread", log_interval=0, dashboard=False)
    server = ServerThread(app).start()
    name = json.loads(_get(server.port, "/v1/models"))["data"][0]["id"]
    rng = random.Random(0)
    results: list = []

    def stream(n: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        body = {"model": name, "prompt": [rng.randrange(3, 30000) for _ in range(128)], "max_tokens": n,
                "temperature": 0.0, "stream": True, "ignore_eos": True, "min_tokens": n}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        results.append((resp.status, data.count(b"data: ")))

    stream(4)  # warm-up
    engine.pause()
    results.clear()
    on[0] = True
    threads = [threading.Thread(target=stream, args=(args.new_tokens,)) for _ in range(args.conc)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine.num_waiting < args.conc and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.resume()
    for t in threads:
        t.join()
    on[0] = False
    assert all(status == 200 for status, _ in results) and len(results) == args.conc, results
    Path(args.child_out).write_text(json.dumps(dict(counts)))
    server.stop()
    engine.shutdown()


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    return conn.getresponse().read()


def count(root: Path, args) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-out", str(out), "--model", args.model,
           "--conc", str(args.conc), "--new-tokens", str(args.new_tokens)]
    subprocess.run(cmd, check=True, cwd=root, env=dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts = json.loads(out.read_text())
    out.unlink()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--before", default=None, help="another checkout, counted alike")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--child-out", default=None)
    args = ap.parse_args()
    if args.child_out:
        child(args)
        return
    sides = {"after": Path(__file__).resolve().parents[1]}
    if args.before:
        sides = {"before": Path(args.before).resolve(), **sides}
    counts = {side: count(root, args) for side, root in sides.items()}
    tokens = args.conc * args.new_tokens
    torch_op = lambda k: k.startswith(("C:Tensor.", "C:_VariableFunctionsClass.", "C:_TensorBase."))  # noqa: E731
    print(f"{args.model}: {args.conc} streams x {args.new_tokens} tokens, calls per streamed token")
    for side, c in counts.items():
        print(f"  {side:6}  all calls {sum(c.values()) / tokens:8.1f}   Python {sum(v for k, v in c.items() if not k.startswith('C:')) / tokens:7.1f}"
              f"   torch ops {sum(v for k, v in c.items() if torch_op(k)) / tokens:6.2f}")
    if args.before:
        b, a = counts["before"], counts["after"]
        print(f"  after/before all calls: {sum(a.values()) / max(1, sum(b.values())):.3f}")
        print("  largest differences (before, after, function):")
        for k in sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))[:args.top]:
            print(f"    {b.get(k, 0):8d} {a.get(k, 0):8d}  {k}")


if __name__ == "__main__":
    main()
