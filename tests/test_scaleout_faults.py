"""Faults across processes, on a real `pagedserve serve` (a subprocess), checked by PID.

- SIGKILL a tensor-parallel rank under load: every request in flight ends with an error
  within seconds (never a hang), /health turns 503, the server exits non-zero and its log
  names the dead rank; no process of the group is left.
- SIGKILL the engine-core process: the same, naming the engine core process.
- SIGTERM the server: every process (API, engine core, ranks) exits 0; none is left behind:
  tests/test_server_shutdown.py's tp2-SIGTERM case checks that, on a server with requests in
  flight (one tensor-parallel server start instead of two).

Every wait has a deadline.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300.0
ERROR_TIMEOUT = 30.0
EXIT_TIMEOUT = 60.0


def children(pid: int) -> list[int]:
    """Direct children of a process, from /proc (Linux)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its entry waits to be reaped


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`pagedserve serve` in a subprocess, its log in a file, its process tree by PID."""

    def __init__(self, tmp_path: Path, model: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "serve.log"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--port", str(self.port),
             "--num-kv-blocks", "128", "--max-model-len", "256", "--log-interval", "0",
             "--uvicorn-log-level", "warning", *flags],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited at start-up:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a refused connect costs nothing: a short poll saves each start ~0.2 s
        else:
            self.kill()
            pytest.fail(f"the server did not start within {START_TIMEOUT:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def tree(self) -> list[int]:
        """The server and every descendant (engine core, ranks)."""
        pids, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo += children(pid)
        return pids

    def wait_exit(self) -> int | None:
        try:
            return self.proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        for pid in reversed(self.tree()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


def wait_gone(pids: list[int], timeout: float = EXIT_TIMEOUT) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def stream_until_error(url: str, results: list, started: threading.Event) -> None:
    """One long streaming completion; records 'ok <monotonic time it ended>', 'error: ...' or 'hang'."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(ERROR_TIMEOUT, connect=5)) as r:
            if r.status_code != 200:
                results.append(f"error: HTTP {r.status_code}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                data = line[6:]
                if data == "[DONE]":
                    break
                if "error" in json.loads(data):
                    results.append(f"error: {data}")
                    return
        results.append(f"ok {time.monotonic()}")
    except httpx.ReadTimeout:
        results.append("hang")
    except httpx.HTTPError as e:  # the server closed the connection: also an error, not a hang
        results.append(f"error: {type(e).__name__}")


def kill_under_load(server: Served, victim: int) -> tuple[list[str], set[int], int | None]:
    results: list[str] = []
    started = threading.Event()
    threads = [threading.Thread(target=stream_until_error, args=(server.url, results, started)) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(ERROR_TIMEOUT), "no request produced a token"
    pids = server.tree()
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    health: set[int] = set()
    deadline = time.monotonic() + ERROR_TIMEOUT
    while time.monotonic() < deadline and 503 not in health and server.proc.poll() is None:
        try:
            health.add(httpx.get(server.url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    for t in threads:
        t.join(ERROR_TIMEOUT + 5)
    assert not any(t.is_alive() for t in threads), "a request is still waiting"
    code = server.wait_exit()
    assert not wait_gone(pids), f"processes left behind: {[p for p in pids if alive(p)]}"
    # A stream that ran its 200 tokens out before the kill was not in flight (a tiny model's step is a
    # fraction of a millisecond): only the others count, and at least one must have been cut.
    in_flight = [r for r in results if not (r.startswith("ok ") and float(r.split()[1]) < killed_at)]
    assert in_flight, f"every stream finished before the kill: {results}"
    return in_flight, health, code


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from checkpoints import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("faults"), "llama")


def test_sigkill_a_rank_fails_requests_turns_health_503_and_exits_naming_it(tmp_path, model):
    server = Served(tmp_path, model, "--tensor-parallel-size", "2", "--engine-core-mode", "process")
    rank_pids = kill_a_rank_under_load(server, 1, num_ranks=2)
    log = server.log()
    # The killed rank is the cause, named first (its peer, which dies of it, comes after).
    assert f"tensor-parallel rank 1 (pid {rank_pids[1]}) died: killed by SIGKILL" in log, log[-3000:]


def assert_failed_loudly(results: list[str], health: set[int], code: int | None) -> None:
    """Every in-flight request ended with an error (none hung), /health turned 503, and the
    server exited non-zero."""
    assert results and all(r.startswith("error") for r in results), results
    assert 503 in health
    assert code not in (None, 0), code


def kill_a_rank_under_load(server: Served, rank: int, num_ranks: int) -> list[int]:
    """SIGKILL rank `rank` of the `num_ranks` (each a child of the engine-core process) while
    requests stream; every one of them must fail loudly. Returns the ranks' pids."""
    try:
        core = _core_pid(server)
        rank_pids = _rank_pids(server)
        assert len(rank_pids) == num_ranks and set(rank_pids) <= set(children(core)), (rank_pids, children(core))
        results, health, code = kill_under_load(server, rank_pids[rank])
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert_failed_loudly(results, health, code)
    return rank_pids


def _core_pid(server: Served) -> int:
    """The engine core's pid, as the API process logged it (a child of the server)."""
    import re
    m = re.search(r"engine core process pid (\d+)", server.log())
    assert m, server.log()[-3000:]
    pid = int(m.group(1))
    assert pid in children(server.proc.pid)
    return pid


def _rank_pids(server: Served) -> list[int]:
    """The ranks' pids, as the engine core logged them when it started them."""
    import re
    m = re.search(r"tensor parallel: \d+ ranks \(pids ([\d, ]+)\)", server.log())
    assert m, server.log()[-3000:]
    return [int(p) for p in m.group(1).split(",")]


def test_sigkill_the_engine_core_process_fails_requests_and_exits(tmp_path, model):
    server = Served(tmp_path, model, "--engine-core-mode", "process")
    try:
        core = _core_pid(server)
        results, health, code = kill_under_load(server, core)
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert_failed_loudly(results, health, code)
    assert f"engine core process (pid {core}) died: killed by SIGKILL" in server.log()
