"""Engine behaviour: stops, aborts, n>1, bad input, start-up refusal, pool sizing."""
from __future__ import annotations

import dataclasses
import json

import pytest

from checkpoints import HFGreedyReference, hf_greedy, make_checkpoint
from pagedserve import LLM, EngineConfig, SamplingParams


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


def token_boundary_stop(tokenizer, token_ids: list[int]) -> tuple[str, str, int]:
    """(text, stop, where): a stop string made of the end of one output token's text and the
    start of the next one's, whose first occurrence in the text is exactly there. Tokens whose
    text is a partial character are not used as ends."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    ends = [len(tokenizer.decode(token_ids[:k + 1], skip_special_tokens=True)) for k in range(len(token_ids))]
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in token_ids]
    for k in range(1, len(token_ids) - 1):
        start, boundary, end = ends[k - 1], ends[k], ends[k + 1]
        clean = all(pieces[i] and "\ufffd" not in pieces[i] and ends[i] - ends[i - 1] == len(pieces[i])
                    for i in (k, k + 1))
        if clean:
            stop = text[max(start, boundary - 2):min(end, boundary + 2)]
            where = boundary - min(2, boundary - start)
            if text.find(stop) == where:
                return text, stop, where
    raise AssertionError("no token boundary usable for a stop string: choose another prompt")


def test_stop_string_across_token_boundaries(llm):
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text, stop, where = token_boundary_stop(llm.get_tokenizer(), base.token_ids)
    assert text.startswith(base.text) and where + len(stop) <= len(base.text)  # (a trailing partial character is never shown)
    # the stop really straddles: no single token's text contains it
    assert not any(stop in llm.get_tokenizer().decode([t]) for t in base.token_ids)
    cut = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:where]
    # generation ended with the token that completed the stop, not later
    assert cut.token_ids == base.token_ids[:len(cut.token_ids)]
    assert stop in llm.get_tokenizer().decode(cut.token_ids) and stop not in llm.get_tokenizer().decode(cut.token_ids[:-1])
    kept = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True,
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:where + len(stop)]
    assert pool_is_whole(llm)


def checkpoint_with_eos(src, dst, eos_id: int):
    """The same weights and tokenizer, with generation_config.json naming `eos_id` an EOS token."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    gen = json.loads((src / "generation_config.json").read_text()) if (src / "generation_config.json").exists() else {}
    gen["eos_token_id"] = [eos_id]
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_stop_token_ids_and_eos(llm, tiny_llama, tmp_path):
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[4]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok

    # EOS: the same model, told (as a checkpoint tells it) that one of its greedy tokens is EOS.
    eos_llm = LLM(str(checkpoint_with_eos(tiny_llama, tmp_path / "eos", stop_tok)), num_kv_blocks=64,
                  max_model_len=128)
    at = base.index(stop_tok)
    out = eos_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:at + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None  # EOS, not a stop token or string
    ignored = eos_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == base and ignored.finish_reason == "length"
    # min_tokens: EOS cannot end (nor be sampled) before the minimum
    held = eos_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, min_tokens=at + 2),
                            use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= at + 2 and stop_tok not in held.token_ids[:at + 2]


def test_max_model_len_exactly_at_the_boundary(tiny_llama):
    """max_model_len = 48 = 3 blocks, and a pool of exactly those 3 blocks: a request may fill
    the context to the last position, and not one token more."""
    with pytest.raises(ValueError, match="needs 3 blocks"):
        LLM(str(tiny_llama), num_kv_blocks=2, max_model_len=48)
    llm = LLM(str(tiny_llama), num_kv_blocks=3, max_model_len=48)
    greedy = dict(temperature=0, ignore_eos=True)
    full = llm.generate([[3] * 40], SamplingParams(max_tokens=None, **greedy), use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 8 and full.finish_reason == "length"   # 40 + 8 = 48 exactly
    last = llm.generate([[4] * 47], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)[0].outputs[0]
    assert len(last.token_ids) == 1                                     # 47 + 1 = 48: accepted
    assert [full.token_ids, last.token_ids] == hf_greedy(tiny_llama, [[3] * 40, [4] * 47], [8, 1])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[4] * 47], SamplingParams(max_tokens=2, **greedy), use_tqdm=False)   # 49
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[4] * 48], SamplingParams(max_tokens=None, **greedy), use_tqdm=False)  # no room
    assert pool_is_whole(llm)


def test_repeated_prompt_of_whole_blocks_matches_hf(llm, tiny_llama):
    """A prompt of exactly 3 x block_size tokens, again and again: every block of the repeat is
    cached except the last, whose final token must still be computed to sample from."""
    prompt = [(7 * i) % 300 + 2 for i in range(48)]
    ref = hf_greedy(tiny_llama, [prompt], [10])[0]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    together = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert again.num_cached_tokens == 32  # 2 of 3 blocks from the cache
    for out in (first, again, *together):
        assert out.outputs[0].token_ids == ref
    assert pool_is_whole(llm)


def test_sliding_window_with_prefill_chunks_smaller_than_the_window(tmp_path):
    """Mistral with a 48-token window, prompts of 150 and 97 tokens prefilled 20 tokens a step
    (less than the window, and not a multiple of the block size), then decoding past it."""
    path = make_checkpoint(tmp_path / "mistral", "mistral", sliding_window=48)
    prompts = [[(11 * i) % 380 + 2 for i in range(150)], [(5 * i) % 370 + 3 for i in range(97)]]
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=20)
    assert all(len(p) > 20 for p in prompts)  # so every prompt is prefilled in chunks
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)]
    windowed = HFGreedyReference(path)
    assert all(len(g) == 12 and windowed.first_divergence(p, g) is None for p, g in zip(prompts, got))
    # The same weights with full attention would not have produced these tokens: the window mattered.
    full_attention = HFGreedyReference(make_checkpoint(tmp_path / "full", "mistral", sliding_window=None))
    assert any(full_attention.first_divergence(p, g) is not None for p, g in zip(prompts, got))


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
    assert pool_is_whole(llm) and not e.output_processor.requests


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


def test_an_engine_resolves_a_read_only_copy_and_leaves_its_config_unchanged(llm):
    """The front-end resolves the config once (engine/resolve.py) into a read-only copy: the
    caller's EngineConfig keeps its Nones (one config can build several engines), and nothing
    built from the copy can rewrite a knob."""
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    from pagedserve.engine.llm_engine import EngineFrontend
    from pagedserve.model.config import read_model_config

    config = EngineConfig(num_kv_blocks=64)
    before = dataclasses.asdict(config)
    frontend = EngineFrontend(config)  # resolves as Engine does, without loading weights
    assert dataclasses.asdict(config) == before
    resolved = frontend.config
    assert resolved is not config and resolved.model == str(DEFAULT_MODEL_DIR)
    assert resolved.max_model_len == read_model_config(DEFAULT_MODEL_DIR).max_model_len
    assert resolved.max_num_batched_tokens == 2048 and frontend.settings.kv_cache_dtype == "float32"
    with pytest.raises(AttributeError, match="^max_num_seqs: .*read-only"):
        llm.engine.config.max_num_seqs = 1
    assert llm.engine.config.max_num_seqs == 128 == llm.engine.scheduler.config.max_num_seqs


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
