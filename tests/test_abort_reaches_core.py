"""A client that hangs up has its request ended in the engine core, not only in the API process.

The other disconnect tests ask for a few hundred tokens: a core that never heard of the abort
finishes such a request by itself inside their wait for idle, and they pass. Here the request
cannot finish by itself (max_tokens 100000, ignore_eos, a context long enough to accept it), so
the core is idle again only if the abort reached it: in thread mode through ThreadCoreClient's
command queue, in process mode as a FinishMsg over ZMQ to the engine-core process.

What is observed is what an operator sees, the same in both modes: the /metrics gauges the core's
SchedulerStats feed (requests running and waiting, KV tokens held). No block held means every
block is free or cached-and-evictable (`kv_cache_used_tokens` counts blocks with a reference).
"""
from __future__ import annotations

import time

import httpx
import pytest

from checkpoints import make_checkpoint
from metrics_scrape import scrape
from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

MAX_TOKENS = 100_000
MAX_MODEL_LEN = 110_000  # accepts prompt + MAX_TOKENS (the server refuses what cannot fit)
BLOCK = 16
# The engine refuses a pool that cannot hold one request of max_model_len: 6875 blocks of 16.
NUM_BLOCKS = -(-MAX_MODEL_LEN // BLOCK)
ABORT_WAIT_S = 30.0  # a wait, not a timing assert: only a hang turns into a failure

RUNNING = "pagedserve:num_requests_running{}"
WAITING = "pagedserve:num_requests_waiting{}"
USED = "pagedserve:kv_cache_used_tokens{}"
TOTAL = "pagedserve:kv_cache_total_tokens{}"
COMPUTED = "pagedserve:iteration_tokens_total_sum{}"
ABORTED = "pagedserve:request_success_total{finished_reason=abort}"
LENGTH = "pagedserve:request_success_total{finished_reason=length}"


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """tiny_llama's shapes with room for 131072 positions, so max_tokens 100000 is accepted."""
    return make_checkpoint(tmp_path_factory.mktemp("long_llama"), "llama", max_pos=131_072)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, long_context_model):
    config = EngineConfig(model=str(long_context_model), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                          max_model_len=MAX_MODEL_LEN, max_num_seqs=4, enable_prefix_caching=False)
    app, async_engine = build_server(config, engine_core_mode=request.param)
    with ServerThread(app) as st:
        st.async_engine = async_engine
        st.mode = request.param
        yield st


def wait_for_core_idle(server, deadline_s: float) -> dict[str, float]:
    """Poll /metrics until the core runs nothing, queues nothing and holds no block; the last
    scrape either way."""
    end = time.monotonic() + deadline_s
    while True:
        m = scrape(server)
        if m[RUNNING] == 0 and m[WAITING] == 0 and m[USED] == 0:
            return m
        if time.monotonic() > end:
            return m
        time.sleep(0.05)


def stream_then_hang_up(server, body: dict, num_chunks: int) -> int:
    """Read `num_chunks` token chunks of a streamed completion, then close the connection."""
    got = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == num_chunks:
                    break
    return got


def test_disconnect_ends_the_request_in_the_core(server):
    before = wait_for_core_idle(server, 60)
    assert before[RUNNING] == 0 and before[USED] == 0
    body = {"prompt": list(range(3, 23)), "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    assert stream_then_hang_up(server, body, num_chunks=3) == 3
    # While it streamed, the core really ran it and held its blocks (so "idle" below is news).
    after = wait_for_core_idle(server, ABORT_WAIT_S)
    assert after[RUNNING] == 0 and after[WAITING] == 0, \
        f"{server.mode} mode: the core still runs the request whose client left ({after[RUNNING]} running)"
    assert after[USED] == 0, f"{server.mode} mode: {after[USED]} KV tokens still held after the abort"
    assert after[TOTAL] == NUM_BLOCKS * BLOCK
    # It was aborted, not finished by itself: far fewer tokens computed than it asked for.
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[LENGTH] == before[LENGTH]
    assert after[COMPUTED] - before[COMPUTED] < MAX_TOKENS // 2
    if server.mode == "thread":  # the core's own books agree with the gauges
        engine = server.async_engine.engine
        assert not engine.has_unfinished_requests()
        pool = engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    else:
        assert server.async_engine.client.process.is_alive()


def test_the_core_held_the_request_while_the_client_was_there(server):
    """The premise of the test above: a live client's request runs in the core and holds blocks,
    so the gauges read busy while it streams (they are fed by the core, not by the API side)."""
    body = {"prompt": list(range(3, 23)), "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    seen_busy, num_chunks = None, 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            num_chunks += 1
            if num_chunks > 200:
                break
            m = scrape(server)
            if m[RUNNING] == 1 and m[USED] > 0:
                seen_busy = m
                break
    assert seen_busy is not None and seen_busy[USED] >= 2 * BLOCK  # the 20-token prompt's 2 blocks
    after = wait_for_core_idle(server, ABORT_WAIT_S)
    assert after[RUNNING] == 0 and after[USED] == 0
