"""What the server says when part of the engine dies.

- A tensor-parallel rank killed under load takes its peers down with it (gloo: "connection
  reset by peer", then the peer exits 1): the message names the killed rank as the cause, and
  the ranks that followed after it, whatever their rank numbers.
- The first /health answer after the engine-core process dies names the reason, also before
  the API process's receiver has noticed the death (it looks between messages).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pagedserve.worker.multiproc_executor import MultiprocExecutor, WorkerDied, _Rank


class _DeadProcess:
    """What the executor reads of a rank's process once it has ended; its sentinel is a pipe whose
    writer is closed, so multiprocessing.connection.wait sees it fire as a dead process's does."""

    def __init__(self, pid: int, exitcode: int) -> None:
        self.pid = pid
        self.exitcode = exitcode
        self._r, w = os.pipe()
        os.close(w)
        self.sentinel = self._r

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def close(self) -> None:
        os.close(self._r)


def _executor_with(ranks: list[_Rank]) -> MultiprocExecutor:
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # the fault bookkeeping only, no processes
    executor.tp = len(ranks)
    executor.ranks = ranks
    executor._failure = None
    executor._deaths = []
    executor._reap_lock = threading.Lock()
    executor._closing = False
    return executor


def test_the_killed_rank_is_named_first_and_the_peer_that_followed_after_it():
    echo = _Rank(0, _DeadProcess(1000, 1), None, None)                  # exited 1: gloo lost its peer
    killed = _Rank(1, _DeadProcess(1001, -signal.SIGKILL), None, None)  # the one that was killed
    executor = _executor_with([echo, killed])
    try:
        with pytest.raises(WorkerDied) as e:
            executor._raise_dead()  # both found dead at once: the kill is the cause
        message = str(e.value)
        assert message.startswith("tensor-parallel rank 1 (pid 1001) died: killed by SIGKILL"), message
        assert "then rank 0 (pid 1000): exit code 1" in message, message
    finally:
        for r in (echo, killed):
            r.process.close()


def test_a_death_seen_first_is_the_cause_even_when_it_was_an_exit():
    first = _Rank(1, _DeadProcess(2001, 1), None, None)   # failed on its own (an error, exit 1)
    later = _Rank(0, _DeadProcess(2000, 1), None, None)
    executor = _executor_with([later, first])
    try:
        with pytest.raises(WorkerDied) as e:
            executor._raise_dead([first])  # the monitor saw rank 1's sentinel fire first
        assert str(e.value).startswith("tensor-parallel rank 1 (pid 2001) died: exit code 1"), str(e.value)
    finally:
        for r in (first, later):
            r.process.close()


def test_the_first_health_answer_after_the_engine_core_process_dies_names_why(tiny_llama, monkeypatch):
    from pagedserve.config import EngineConfig
    from pagedserve.engine import core_client
    from pagedserve.server.launcher import ServerThread, build_server

    # The receiver looks for a dead core only between messages; a long look leaves a wide
    # window in which the process is gone and the loop does not know it yet.
    monkeypatch.setattr(core_client, "RECV_POLL_SECONDS", 10.0)
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    app, async_engine = build_server(config, log_interval=0, engine_core_mode="process", dashboard=False)
    with ServerThread(app) as server:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        process = async_engine.client.process
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process.is_alive():
            assert time.monotonic() < deadline, "the engine core process did not die"
            time.sleep(0.01)
        assert async_engine.dead_error is None  # the loop has not heard of it yet: the case at hand
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503
        message = health.json()["error"]["message"]
        assert f"engine core process (pid {process.pid}) died: killed by SIGKILL" in message, message
