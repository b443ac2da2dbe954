"""Engine behaviour: stops, aborts, n>1, bad input, start-up refusal, pool sizing."""
from __future__ import annotations

import json

import pytest

from checkpoints import hf_greedy, make_checkpoint
from pagedserve import LLM, EngineConfig, SamplingParams
from pagedserve.engine import Engine


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=128, max_model_len=512)


def pool_is_whole(llm) -> bool:
    e = llm.engine
    return e.block_pool.num_free_blocks == e.block_pool.num_blocks and not e.scheduler.requests


def test_text_prompt_and_outputs_shape(llm):
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 7 and comp.finish_reason == "length"
    assert comp.text == llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == llm.get_tokenizer()("def fibonacci(n):").input_ids
    assert pool_is_whole(llm)


def test_stop_string_across_token_boundaries(llm):
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 12
    stop = text[5:9]  # four characters that may straddle tokens
    cut = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert pool_is_whole(llm)


def test_stop_token_ids_and_eos(llm, tiny_llama):
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[4]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_max_model_len_stops_generation(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=16, max_model_len=40)
    out = llm.generate([[3] * 30], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_n_samples_are_distinct_and_seeded(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3
    again = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert pool_is_whole(llm)


def test_abort_returns_blocks_immediately(llm):
    e = llm.engine
    e.add_request("x", [4] * 100, SamplingParams(max_tokens=50, ignore_eos=True))
    e.add_request("y", [5] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()
    e.step()
    assert e.kv_cache_manager.num_used_blocks > 0
    assert e.abort("x") and e.abort("y")
    assert e.kv_cache_manager.num_used_blocks == 0
    assert not e.has_unfinished_requests()
    assert not e.abort("x")  # unknown now


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt"),
    ([1] * 600, SamplingParams(), "prompt"),
    ([1] * 500, SamplingParams(max_tokens=20), "max_tokens"),
    ([10**6], SamplingParams(), "prompt"),
    ([1, 2], SamplingParams(logprobs=10**3), "logprobs"),
])
def test_bad_requests_change_nothing(llm, prompt, params, field):
    e = llm.engine
    with pytest.raises(ValueError, match=field):
        llm.generate([[1, 2, 3], prompt], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert pool_is_whole(llm) and not e.groups


@pytest.mark.parametrize("kw,knob", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=-3), "max_tokens"),
    (dict(top_k=-5), "top_k"), (dict(n=0), "n"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_sampling_params_validation(kw, knob):
    with pytest.raises(ValueError, match=knob):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,knob", [
    (dict(block_size=12), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(kv_cache_memory="lots"), "kv_cache_memory"),
    (dict(dtype="int3"), "dtype"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(preemption_mode="pray"), "preemption_mode"), (dict(num_kv_blocks=0), "num_kv_blocks"),
])
def test_engine_config_validation(kw, knob):
    with pytest.raises(ValueError, match=knob):
        EngineConfig(**kw)


def test_refuses_to_start_when_one_request_cannot_fit(tiny_llama):
    with pytest.raises(ValueError, match=r"max_model_len=1024 tokens needs 64 blocks"):
        LLM(str(tiny_llama), num_kv_blocks=10)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_llama), max_model_len=4096)  # beyond max_position_embeddings
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_unknown_architecture_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "missing"))


def test_bf16_checkpoint_and_sharded_weights(tmp_path):
    """A bf16 checkpoint computed in fp32, saved in several shards, still matches HF."""
    import torch
    import transformers
    path = make_checkpoint(tmp_path / "m", "llama", dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (path / f).exists():
            (tmp_path / "sharded" / f).write_bytes((path / f).read_bytes())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompts = [[5, 6, 7, 8], [9] * 40]
    ref = hf_greedy(tmp_path / "sharded", prompts, [12, 12])
    llm = LLM(str(tmp_path / "sharded"), dtype="float32", num_kv_blocks=64)
    got = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == ref
