"""Aborts at awkward moments: mid-prefill, while swapped to host memory, and of an n=3 group.
Every device and host block comes back, and running the same requests again gives exactly
the output an uninterrupted run gives (HF's, for greedy requests).

The engine's internals are read only through the helpers at the top (state of one request,
pool and host-pool occupancy, draining with outputs), so an engine redesign adapts them here.
"""
from __future__ import annotations

from checkpoints import HFGreedyReference, hf_greedy
from pagedserve import LLM, SamplingParams
from pagedserve.core.request import RequestStatus

GREEDY = dict(temperature=0, ignore_eos=True)


# -- the engine's internals, read in one place ------------------------------------------------
def progress(engine, request_id: str) -> tuple[RequestStatus, int, int]:
    """(status, tokens computed, prompt tokens) of one running sequence."""
    req = engine.scheduler.requests[request_id]
    return req.status, req.num_computed_tokens, req.num_prompt_tokens


def swapped_ids(engine) -> list[str]:
    return [r.request_id for r in engine.scheduler.swapped]


def blocks_in_use(engine) -> tuple[int, int]:
    """(device blocks held by requests, host blocks held by swapped requests)."""
    host = engine.kv_cache_manager.host_pool
    return engine.block_pool.num_used_blocks, (host.num_used_blocks if host is not None else 0)


def num_sequences(engine) -> int:
    """Sequences the scheduler still tracks (an n=3 request is three)."""
    return len(engine.scheduler.requests)


def host_pool_size(engine) -> int:
    return engine.kv_cache_manager.host_pool.num_blocks


def drain(engine, max_steps: int = 10_000) -> dict[str, list[list[int]]]:
    """Step until idle; the final token ids of every request that finished, by request id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    raise AssertionError(f"the engine did not finish within {max_steps} steps")


def assert_all_blocks_back(engine) -> None:
    assert blocks_in_use(engine) == (0, 0)
    assert not engine.has_unfinished_requests()


# -- the tests -------------------------------------------------------------------------------
def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt) % 380 + 2 for i in range(n)]


def test_abort_mid_prefill_returns_blocks_and_the_rerun_is_exact(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=32, max_model_len=256, max_num_batched_tokens=32)
    engine = llm.engine
    long_prompt = prompt(100, 1)
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    status, computed, num_prompt = progress(engine, "long")
    assert status == RequestStatus.RUNNING and 0 < computed < num_prompt  # really mid-prefill
    assert blocks_in_use(engine)[0] > 0
    assert engine.abort("long")
    assert_all_blocks_back(engine)
    # The rerun may reuse the aborted request's computed blocks from the prefix cache; either way
    # its tokens are HF's.
    again = llm.generate([long_prompt], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert again.num_cached_tokens == computed  # (32 tokens = 2 full blocks were computed)
    assert again.outputs[0].token_ids == hf_greedy(tiny_llama, [long_prompt], [8])[0]
    assert_all_blocks_back(engine)


def test_abort_while_swapped_returns_host_blocks_and_the_rerun_is_exact(tiny_llama):
    # 8 blocks for three requests that grow to 5 blocks each: someone is swapped out.
    llm = LLM(str(tiny_llama), num_kv_blocks=8, max_model_len=128, preemption_mode="swap", swap_space="4MiB",
              enable_prefix_caching=False)
    engine = llm.engine
    prompts = {f"r{k}": prompt(40 + 10 * k, k) for k in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=36, **GREEDY))
    for _ in range(200):
        engine.step()
        if swapped_ids(engine):
            break
    victim = swapped_ids(engine)[0]
    assert progress(engine, victim)[0] == RequestStatus.SWAPPED and blocks_in_use(engine)[1] > 0
    assert engine.abort(victim)
    assert blocks_in_use(engine)[1] == 0 and victim not in swapped_ids(engine)
    finished = drain(engine)
    assert_all_blocks_back(engine)
    assert set(finished) == set(prompts) - {victim}
    hf = HFGreedyReference(tiny_llama)
    for rid, [tokens] in finished.items():
        assert len(tokens) == 36 and hf.first_divergence(prompts[rid], tokens) is None, rid
    rerun = llm.generate([prompts[victim]], SamplingParams(max_tokens=36, **GREEDY), use_tqdm=False)[0]
    tokens = rerun.outputs[0].token_ids
    assert len(tokens) == 36 and hf.first_divergence(prompts[victim], tokens) is None
    assert_all_blocks_back(engine)
    assert host_pool_size(engine) > 0


def test_abort_of_an_n3_group_frees_every_sample(tiny_llama):
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=20, ignore_eos=True)
    p = prompt(45, 9)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=128)
    engine = llm.engine
    expected = [c.token_ids for c in llm.generate([p], params, use_tqdm=False)[0].outputs]  # uninterrupted
    assert len({tuple(t) for t in expected}) == 3

    engine.add_request("group", p, params)
    engine.add_request("bystander", prompt(30, 4), SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(4):
        engine.step()
    assert num_sequences(engine) == 4
    assert engine.abort("group")
    assert not engine.abort("group")  # gone: a second abort finds nothing
    assert num_sequences(engine) == 1
    computed = progress(engine, "bystander")[1]
    assert blocks_in_use(engine)[0] == -(-computed // 16)  # only the bystander's blocks remain
    finished = drain(engine)
    assert set(finished) == {"bystander"}
    assert_all_blocks_back(engine)
    again = [c.token_ids for c in llm.generate([p], params, use_tqdm=False)[0].outputs]
    assert again == expected
    assert_all_blocks_back(engine)
