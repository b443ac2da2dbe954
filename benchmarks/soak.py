"""Soak: waves of mixed traffic against a real `pagedserve serve` on a small pool, then a SIGTERM
with requests in flight. Measures what must not drift or leak, wave after wave:

    requests      answered requests in the wave (streams dropped on purpose are counted apart)
    5xx           answers with a 5xx status (or a 5xx error event inside a stream)
    lost          no answer: a timeout, a cut connection, a stream without [DONE]
    bad json      a json_schema answer that finished ("stop") but does not hold to the schema
    preemptions   pagedserve:num_preemptions_total gained in the wave (the pool is small on purpose)
    wrong usage   usage that disagrees with what came back (logprob entries per token, or
                  n * max_tokens for a request cut by length)
    canary        greedy canaries (temperature 0, ignore_eos) whose text differs from the first
                  run's (the first configuration's first wave): preemption, batching and layout
                  must change no greedy output
    RSS           resident memory of the server and all its children (engine core, ranks), MiB,
                  read from /proc after the wave

The mix per wave, drawn with a fixed seed: 20% streams that the client drops after a few chunks,
streams with usage, n=2 sampled requests, stop strings, logprobs, chat with a json_schema
response_format; every request under ~24 concurrent clients on a pool of --num-kv-blocks blocks,
small enough that requests are preempted (swap or recompute). After the last wave: a final wave
is started and the server gets SIGTERM while it runs; printed are the exit status and how the
in-flight requests ended (finished / ended with the shutdown error / lost).

    python benchmarks/soak.py                                  # thread, process, tp2 x swap, recompute
    python benchmarks/soak.py --modes thread --preemption-modes recompute --waves 2 --requests-per-wave 24
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import benchmark_checkpoint  # noqa: E402
from live import Server, env, free_port, load_average  # noqa: E402

MODE_FLAGS = {
    "thread": ["--engine-core-mode", "thread"],
    "process": ["--engine-core-mode", "process"],
    "tp2": ["--engine-core-mode", "process", "--tensor-parallel-size", "2"],
}
CANARY_PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 3, 9, 12], [250, 251]]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TIMEOUT = httpx.Timeout(120.0, connect=10.0)


@dataclass
class Wave:
    requests: int = 0
    dropped: int = 0
    server_errors: int = 0
    lost: int = 0
    wrong_usage: int = 0
    canary_mismatch: int = 0
    bad_json: int = 0
    preemptions: int = 0
    problems: list[str] = field(default_factory=list)


def preemptions(server: Server) -> int:
    """pagedserve:num_preemptions_total, summed over its mode label."""
    total = 0.0
    for line in server.metrics_text().splitlines():
        if line.startswith("pagedserve:num_preemptions_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def rss_mib(pid: int) -> float:
    """VmRSS of pid and every descendant, MiB (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1024


# -- the requests ---------------------------------------------------------------------------------
def make_requests(rng: random.Random, count: int, max_tokens: int) -> list[dict]:
    """`count` request specs: kind, endpoint, body, plus the canaries at fixed places."""
    specs = []
    for i in range(count):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(4, 40))]
        tokens = rng.randrange(8, max_tokens + 1)
        roll = rng.random()
        base = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "seed": i}
        if roll < 0.20:
            specs.append({"kind": "dropped", "path": "/v1/completions", "drop_after": rng.randrange(1, 5),
                          "body": {**base, "stream": True}})
        elif roll < 0.35:
            specs.append({"kind": "stream", "path": "/v1/completions",
                          "body": {**base, "stream": True, "stream_options": {"include_usage": True},
                                   "logprobs": 1}})
        elif roll < 0.50:
            specs.append({"kind": "n2", "path": "/v1/completions",
                          "body": {**base, "n": 2, "temperature": 0.8, "logprobs": 0}})
        elif roll < 0.65:
            specs.append({"kind": "stop", "path": "/v1/completions",
                          "body": {**base, "ignore_eos": False, "stop": ["e", "\n"], "temperature": 0.9,
                                   "logprobs": 0}})
        elif roll < 0.80:
            specs.append({"kind": "logprobs", "path": "/v1/completions",
                          "body": {**base, "logprobs": 3, "temperature": 0.7}})
        else:
            specs.append({"kind": "json", "path": "/v1/chat/completions",
                          "body": {"messages": [{"role": "user", "content": f"person {i}"}],
                                   "max_tokens": max_tokens, "logprobs": True, "seed": i, "temperature": 0.7,
                                   "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": SCHEMA}}}})
    for j, prompt in enumerate(CANARY_PROMPTS):
        at = (j + 1) * count // (len(CANARY_PROMPTS) + 1)
        specs.insert(at, {"kind": "canary", "canary": j, "path": "/v1/completions",
                          "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    return specs


def _tokens_in(choice: dict, chat: bool) -> int | None:
    lp = choice.get("logprobs")
    if lp is None:
        return None
    return len(lp["content"]) if chat else len(lp["tokens"])


def check_usage(spec: dict, body: dict) -> str | None:
    """None if the usage agrees with the answer; else what is wrong."""
    usage, chat = body.get("usage") or {}, spec["path"].endswith("chat/completions")
    counted = [_tokens_in(c, chat) for c in body["choices"]]
    got = usage.get("completion_tokens")
    if all(c is not None for c in counted):
        expected = sum(counted)
    elif all(c["finish_reason"] == "length" for c in body["choices"]):
        expected = spec["body"].get("n", 1) * spec["body"]["max_tokens"]
    else:
        return None
    if got != expected or usage.get("total_tokens") != usage.get("prompt_tokens", 0) + (got or 0):
        return f"{spec['kind']}: usage {usage} but the answer holds {expected} tokens"
    return None


async def run_one(client: httpx.AsyncClient, url: str, spec: dict, wave: Wave, canaries: dict) -> str:
    """Send one request; returns how it ended: ok, dropped, 5xx, lost, error."""
    try:
        if spec["body"].get("stream"):
            return await _stream(client, url, spec, wave)
        r = await client.post(url + spec["path"], json=spec["body"])
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        wave.lost += 1
        wave.problems.append(f"{spec['kind']}: lost ({type(e).__name__})")
        return "lost"
    wave.requests += 1
    if r.status_code >= 500:
        wave.server_errors += 1
        wave.problems.append(f"{spec['kind']}: HTTP {r.status_code} {r.text[:200]}")
        return "5xx"
    if r.status_code != 200:
        wave.problems.append(f"{spec['kind']}: HTTP {r.status_code} {r.text[:200]}")
        return "error"
    body = r.json()
    if spec["kind"] == "json" and body["choices"][0]["finish_reason"] == "stop":
        try:
            value = json.loads(body["choices"][0]["message"]["content"])
            assert isinstance(value, dict) and isinstance(value["name"], str) and isinstance(value["age"], int)
        except (ValueError, KeyError, AssertionError, TypeError):
            wave.bad_json += 1
            wave.problems.append(f"json: {body['choices'][0]['message']['content'][:80]!r} breaks the schema")
    problem = check_usage(spec, body)
    if problem:
        wave.wrong_usage += 1
        wave.problems.append(problem)
    if spec["kind"] == "canary":
        text = body["choices"][0]["text"]
        reference = canaries.setdefault(spec["canary"], text)
        if text != reference:
            wave.canary_mismatch += 1
            wave.problems.append(f"canary {spec['canary']}: {text[:40]!r} != first run's {reference[:40]!r}")
    return "ok"


async def _stream(client: httpx.AsyncClient, url: str, spec: dict, wave: Wave) -> str:
    chunks, usage, done, tokens, error = 0, None, False, 0, None
    async with client.stream("POST", url + spec["path"], json=spec["body"]) as r:
        if r.status_code != 200:
            wave.requests += 1
            wave.server_errors += r.status_code >= 500
            wave.problems.append(f"{spec['kind']}: HTTP {r.status_code}")
            return "5xx" if r.status_code >= 500 else "error"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                continue
            chunks += 1
            if event.get("usage"):
                usage = event["usage"]
            for c in event.get("choices", []):
                if c.get("logprobs"):
                    tokens += len(c["logprobs"]["tokens"])
            if spec["kind"] == "dropped" and chunks >= spec["drop_after"]:
                wave.dropped += 1
                return "dropped"  # leaving the block closes the connection: the server must abort it
    if spec["kind"] == "dropped":  # it ended before we dropped it
        wave.dropped += 1
        return "dropped"
    wave.requests += 1
    if error is not None:
        wave.server_errors += int(error.get("code", 500)) >= 500
        wave.problems.append(f"{spec['kind']}: error event {error}")
        return "5xx" if int(error.get("code", 500)) >= 500 else "error"
    if not done:
        wave.lost += 1
        wave.problems.append(f"{spec['kind']}: stream ended without [DONE]")
        return "lost"
    if usage is None or usage["completion_tokens"] != tokens:
        wave.wrong_usage += 1
        wave.problems.append(f"{spec['kind']}: stream usage {usage} but {tokens} tokens streamed")
    return "ok"


async def run_wave(url: str, specs: list[dict], concurrency: int, canaries: dict) -> Wave:
    wave = Wave()
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)

    async def client_loop(client):
        while not queue.empty():
            await run_one(client, url, queue.get_nowait(), wave, canaries)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return wave


async def sigterm_wave(server: Server, specs: list[dict], concurrency: int) -> dict:
    """Start a wave, SIGTERM the server once every client has a request in flight, and count how
    the requests in flight ended."""
    outcomes: list[str] = []
    wave = Wave()
    specs = [s for s in specs if s["kind"] not in ("dropped", "canary")][:concurrency]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        tasks = [asyncio.ensure_future(run_one(client, server.url, s, wave, {})) for s in specs]
        deadline = time.monotonic() + 30
        # Until half of them are in the engine, or the first one is done: then the signal finds the rest in flight.
        while time.monotonic() < deadline and not any(t.done() for t in tasks):
            text = (await client.get(server.url + "/metrics")).text
            queued = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith(("pagedserve:num_requests_running{", "pagedserve:num_requests_waiting{")))
            if queued >= len(specs) // 2:
                break
            await asyncio.sleep(0.02)
        in_flight = sum(not t.done() for t in tasks)
        server.proc.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
    code = await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 120)
    shutdown_errors = sum(1 for p in wave.problems if "shutting down" in p)
    return {"exit": code, "sent": len(specs), "in_flight_at_signal": in_flight, "finished": outcomes.count("ok"),
            "ended_with_shutdown_error": shutdown_errors, "lost": wave.lost,
            "other": [p for p in wave.problems if "shutting down" not in p][:5]}


# -- one configuration ------------------------------------------------------------------------------
def soak(model: Path, mode: str, preemption: str, args, canaries: dict, log_dir: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--port", str(port),
           "--uvicorn-log-level", "warning", "--log-interval", "0", "--no-dashboard",
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.concurrency), "--preemption-mode", preemption,
           *(["--swap-space", args.swap_space] if preemption == "swap" else []), *MODE_FLAGS[mode]]
    log_path = log_dir / f"soak-{mode}-{preemption}.log"
    server = Server(cmd, port, log_path, env(1), ready_path="/health")
    rng = random.Random(args.seed)
    rows = []
    try:
        rows.append(("start", None, rss_mib(server.proc.pid)))
        for w in range(args.waves):
            specs = make_requests(rng, args.requests_per_wave, args.max_tokens)
            before = preemptions(server)
            wave = asyncio.run(run_wave(server.url, specs, args.concurrency, canaries))
            wave.preemptions = preemptions(server) - before
            rows.append((w + 1, wave, rss_mib(server.proc.pid)))
        # Longer requests for the last wave, so that the signal finds them in flight.
        final = asyncio.run(sigterm_wave(server, make_requests(rng, args.concurrency * 2, args.max_model_len // 2),
                                         args.concurrency))
    finally:
        if server.proc.poll() is None:
            server.stop()
    log = log_path.read_text()
    final["asgi_exceptions"] = log.count("Exception in ASGI application")
    return {"rows": rows, "final": final}


def print_config(mode: str, preemption: str, result: dict) -> None:
    print(f"\n== {mode}, preemption {preemption} ==")
    print(f"{'wave':>5} {'requests':>8} {'dropped':>7} {'5xx':>4} {'lost':>4} {'wrong usage':>11} "
          f"{'canary mismatch':>15} {'bad json':>8} {'preemptions':>11} {'RSS MiB':>8}")
    for wave_no, wave, rss in result["rows"]:
        if wave is None:
            print(f"{wave_no:>5} {'':>8} {'':>7} {'':>4} {'':>4} {'':>11} {'':>15} {'':>8} {'':>11} {rss:>8.0f}")
            continue
        print(f"{wave_no:>5} {wave.requests:>8} {wave.dropped:>7} {wave.server_errors:>4} {wave.lost:>4} "
              f"{wave.wrong_usage:>11} {wave.canary_mismatch:>15} {wave.bad_json:>8} {wave.preemptions:>11} "
              f"{rss:>8.0f}")
        for p in wave.problems[:5]:
            print(f"      ! {p}")
    f = result["final"]
    print(f"SIGTERM with {f['in_flight_at_signal']} of {f['sent']} in flight: exit {f['exit']}, "
          f"finished {f['finished']} of {f['sent']}, "
          f"ended with the shutdown error {f['ended_with_shutdown_error']}, lost {f['lost']}, "
          f"'Exception in ASGI application' in the log: {f['asgi_exceptions']}")
    for p in f["other"]:
        print(f"      ! {p}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="thread,process,tp2")
    p.add_argument("--preemption-modes", default="swap,recompute")
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--requests-per-wave", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--swap-space", default="64MiB")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the 'tiny' benchmark checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/pagedserve-soak")
    args = p.parse_args()
    model = Path(args.model) if args.model else benchmark_checkpoint("tiny")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.waves} waves x {args.requests_per_wave} requests (+{len(CANARY_PROMPTS)} canaries), "
          f"{args.concurrency} clients, {args.num_kv_blocks} KV blocks, model {model}; load {load_average()}")
    canaries: dict = {}  # canary index -> the first run's greedy text
    failed = False
    for mode in args.modes.split(","):
        for preemption in args.preemption_modes.split(","):
            t0 = time.monotonic()
            result = soak(model, mode, preemption, args, canaries, log_dir)
            print_config(mode, preemption, result)
            print(f"({time.monotonic() - t0:.0f} s; server log {log_dir}/soak-{mode}-{preemption}.log)")
            waves = [w for _, w, _ in result["rows"] if w is not None]
            f = result["final"]
            failed |= any(w.server_errors or w.lost or w.wrong_usage or w.canary_mismatch or w.bad_json
                          for w in waves)
            failed |= f["exit"] != 0 or f["lost"] > 0 or f["asgi_exceptions"] > 0
    print("\nsoak:", "FAILED (see the ! lines)" if failed else "clean: nothing lost, no 5xx, usage and canaries agree")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
