"""A real Prometheus scraping a real `pagedserve serve`, both as child processes on loopback.

Used by tests/test_prometheus.py and benchmarks/histogram_accuracy.py. Every process started here
is stopped by the context manager that started it (terminate, then kill after a grace period).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]


DEFAULT_MODEL = ROOT / "pagedserve" / "default_model"


def random_llama(path: Path, hidden: int = 512, layers: int = 8, heads: int = 8, kv_heads: int = 4,
                 intermediate: int = 1536, seed: int = 0) -> Path:
    """A random float32 Llama with the built-in model's tokenizer (vocabulary 4096), written with numpy
    alone (no torch import: seconds, not tens of seconds). Its tokens are noise; its step times are
    what a bigger model's are: mostly matrix products, which release the GIL."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    head_dim = hidden // heads
    config.update(_name_or_path="random-llama", hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  intermediate_size=intermediate, dtype="float32", torch_dtype="float32")
    vocab = config["vocab_size"]
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(intermediate, hidden),
            p + "mlp.up_proj.weight": normal(intermediate, hidden),
            p + "mlp.down_proj.weight": normal(hidden, intermediate),
        })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (DEFAULT_MODEL / name).exists():
            shutil.copy(DEFAULT_MODEL / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """The children import this checkout's pagedserve, not an installed copy; one torch thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_http(url: str, proc: subprocess.Popen, log: Path, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{url} did not answer within {deadline_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@contextmanager
def serving(args: list[str], workdir: Path, command: list[str] | None = None,
            deadline_s: float = 180.0) -> Iterator[str]:
    """`pagedserve serve ARGS` (or `command ARGS`) on a free loopback port; yields its base URL."""
    port = free_port()
    log = workdir / f"serve-{port}.log"
    cmd = (command or [sys.executable, "-m", "pagedserve.cli", "serve"]) + [
        "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/v1/models", proc, log, deadline_s)
        yield url
    finally:
        _stop(proc)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's result vector (a clear error naming the expression if it fails)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=30.0, trust_env=False)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {expr!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def values(self, expr: str, at: float | None = None) -> list[float]:
        return [float(sample["value"][1]) for sample in self.query(expr, at)]

    def scalar(self, expr: str, at: float | None = None) -> float:
        values = self.values(expr, at)
        if len(values) != 1:
            raise AssertionError(f"{expr!r} gave {len(values)} series, expected one")
        return values[0]

    def last_scrape(self, job: str) -> float:
        """Unix time of the last scrape of `job` that Prometheus has stored."""
        result = self.query(f'timestamp(up{{job="{job}"}})')
        return max(float(s["value"][1]) for s in result) if result else -math.inf

    def wait_scrapes_after(self, job: str, t: float, count: int = 2, deadline_s: float = 30.0) -> float:
        """Wait until `count` scrapes of `job` began after unix time `t`; returns the last one's time."""
        end = time.monotonic() + deadline_s
        seen: set[float] = set()
        while True:
            last = self.last_scrape(job)
            # Count only scrapes that succeeded: one that timed out on a loaded machine stores
            # up 0 and marks every series stale, so queries at its time find nothing.
            if last > t and self.values(f'up{{job="{job}"}}', at=last) == [1.0]:
                seen.add(last)
            if len(seen) >= count:
                return last
            if time.monotonic() > end:
                raise AssertionError(f"Prometheus did not scrape {job} {count} times within {deadline_s:.0f} s")
            time.sleep(0.2)


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@contextmanager
def prometheus(targets: dict[str, str], workdir: Path, scrape_interval_s: float = 1.0,
               deadline_s: float = 60.0) -> Iterator[Prometheus]:
    """A Prometheus scraping `{job: base_url}` every `scrape_interval_s`; stopped on exit."""
    binary = prometheus_binary()
    if binary is None:
        raise RuntimeError("no prometheus binary on PATH")
    port = free_port()
    jobs = [{"job_name": job, "scrape_interval": f"{scrape_interval_s:g}s", "scrape_timeout": f"{scrape_interval_s:g}s",
             "metrics_path": "/metrics", "static_configs": [{"targets": [url.split("://", 1)[1]]}]}
            for job, url in targets.items()]
    config = workdir / f"prometheus-{port}.yml"
    # JSON is YAML: no YAML writer needed.
    config.write_text(json.dumps({"global": {"scrape_interval": f"{scrape_interval_s:g}s",
                                             "evaluation_interval": f"{scrape_interval_s:g}s"},
                                  "scrape_configs": jobs}))
    data = workdir / f"prometheus-{port}-data"
    log = workdir / f"prometheus-{port}.log"
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/-/ready", proc, log, deadline_s)
        yield Prometheus(url)
    finally:
        _stop(proc)


def grafana_to_promql(expr: str, window_s: float) -> str:
    """A dashboard expression with Grafana's variables filled in: every model and instance, and a
    rate window of `window_s` seconds."""
    return (expr.replace("$model_name", ".*").replace("$instance", ".*")
            .replace("$__rate_interval", f"{max(1, math.ceil(window_s))}s"))


def run_bench(base_url: str, args: list[str], result_file: Path, timeout_s: float = 600.0) -> dict:
    """`pagedserve bench` against `base_url`; returns its result JSON (per-request raw timings included)."""
    cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", base_url, "--disable-tqdm",
           "--result-file", str(result_file), *args]
    done = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"pagedserve bench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(result_file.read_text())
