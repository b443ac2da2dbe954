"""RoPE parity: greedy output through pagedserve's LLM equals HF transformers' generate token
for token (fp32) for every RoPE type, with a non-default theta, on checkpoints saved by the
installed transformers (the `rope_parameters` layout) and on the pre-5 layout written by hand.

Sequences run well past `original_max_position_embeddings` (64 here) so scaling matters.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from checkpoints import hf_greedy, make_checkpoint
from pagedserve import LLM, SamplingParams
from pagedserve.model.config import read_model_config, read_rope_config
from pagedserve.model.rope import RotaryEmbedding

ORIGINAL = 64  # pretraining length the scaled types extend from

CASES = {
    "default": dict(max_pos=512, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "linear": dict(max_pos=512, rope_parameters={"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}),
    "llama3": dict(max_pos=512, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    # factor only: HF derives the attention factor 0.1 ln(4) + 1 from it
    "yarn": dict(max_pos=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    # every optional yarn knob set away from its default
    "yarn_knobs": dict(max_pos=512, rope_parameters={
        "rope_type": "yarn", "rope_theta": 20000.0, "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
}
# (prompt length, tokens to generate): one grows past ORIGINAL, one starts past it
SHAPES = [(5, 70), (90, 16)]


def workload(seed: int = 0, shapes=SHAPES):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n, _ in shapes]
    return prompts, [m for _, m in shapes]


def make_llm(path, **engine_args) -> LLM:
    # recompute preemption: no host swap pool to build (tens of thousands of blocks by default)
    return LLM(str(path), preemption_mode="recompute", **engine_args)


def greedy(path, prompts, max_tokens, **engine_args) -> list[list[int]]:
    llm = make_llm(path, **engine_args)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: first divergence at token {next(j for j in range(len(w)) if g[j] != w[j])}"


def checkpoint(path, name: str, arch: str = "llama", seed: int = 0):
    case = dict(CASES[name])
    return make_checkpoint(path, arch, seed=seed, max_pos=case.pop("max_pos"), **case)


@pytest.fixture(scope="module", params=list(CASES))
def rope_case(request, tmp_path_factory):
    """A checkpoint saved by the installed transformers and HF's greedy output on it."""
    name = request.param
    path = checkpoint(tmp_path_factory.mktemp(name), name)
    prompts, max_tokens = workload()
    return name, path, prompts, max_tokens, hf_greedy(path, prompts, max_tokens)


def test_rope_parameters_layout_matches_hf(rope_case):
    name, path, prompts, max_tokens, ref = rope_case
    saved = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_scaling" not in saved and "rope_theta" not in saved
    rope = read_model_config(path).rope
    assert rope.rope_type == name.split("_")[0] and rope.theta == saved["rope_parameters"]["rope_theta"]
    # a small token budget chunks the long prompt: chunking must not change RoPE
    got = greedy(path, prompts, max_tokens, num_kv_blocks=64, max_num_batched_tokens=48)
    assert_same(got, ref)


def test_old_layout_written_by_hand_matches_hf(rope_case, tmp_path):
    """The same weights with config.json rewritten as transformers<5 wrote it: top-level
    rope_theta + rope_scaling (spelling the type `type` for one case, `rope_type` for others)."""
    name, path, prompts, max_tokens, ref = rope_case
    old = tmp_path / "old"
    shutil.copytree(path, old)
    cfg = json.loads((old / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    cfg["rope_scaling"] = {("type" if name == "yarn_knobs" else "rope_type"): kind, **params} if params else None
    (old / "config.json").write_text(json.dumps(cfg))
    # HF reads the old layout as the same RoPE, so HF's output on `path` is the reference here too
    import transformers
    hf_old = dict(transformers.AutoConfig.from_pretrained(old).rope_parameters)
    hf_old.pop("type", None)  # HF keeps the old spelling next to the rope_type it derives from it
    assert hf_old == transformers.AutoConfig.from_pretrained(path).rope_parameters
    assert read_model_config(old).rope == read_model_config(path).rope
    assert_same(greedy(old, prompts, max_tokens, num_kv_blocks=64), ref)


def test_qwen2_yarn_and_mistral_theta_match_hf(tmp_path):
    """The other two architectures read RoPE through the same code; one scaled case each."""
    prompts, max_tokens = workload(2, shapes=[(70, 12)])
    qwen = checkpoint(tmp_path / "qwen2", "yarn", arch="qwen2", seed=2)
    assert_same(greedy(qwen, prompts, max_tokens, num_kv_blocks=64), hf_greedy(qwen, prompts, max_tokens))
    mistral = make_checkpoint(tmp_path / "mistral", "mistral", seed=2, max_pos=512, sliding_window=None,
                              rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})
    assert_same(greedy(mistral, prompts, max_tokens, num_kv_blocks=64), hf_greedy(mistral, prompts, max_tokens))


# -- dynamic NTK -------------------------------------------------------------------------

def hf_greedy_fresh(path, prompts, max_tokens):
    """HF's dynamic RoPE keeps its grown base across generate calls until a short input
    resets it; a fresh model per prompt gives each sequence the behaviour of running alone."""
    return [hf_greedy(path, [p], [n])[0] for p, n in zip(prompts, max_tokens)]


@pytest.fixture(scope="module")
def dynamic_case(tmp_path_factory):
    # max_position_embeddings is the length dynamic NTK scales from; the engine runs to 4x it
    path = make_checkpoint(tmp_path_factory.mktemp("dynamic"), "llama", seed=3, max_pos=ORIGINAL,
                           rope_parameters={"rope_type": "dynamic", "rope_theta": 20000.0, "factor": 4.0})
    rng = random.Random(3)
    shared = [rng.randrange(2, 384) for _ in range(80)]
    prompts = [
        [rng.randrange(2, 384) for _ in range(10)],                 # grows past 64 while decoding
        [rng.randrange(2, 384) for _ in range(60)],                 # crosses 64 within a few tokens
        shared + [rng.randrange(2, 384) for _ in range(20)],        # 100 > 64: the whole prompt is scaled
        shared + [rng.randrange(2, 384) for _ in range(44)],        # same 80-token prefix, another length
    ]
    max_tokens = [70, 12, 10, 8]
    return path, prompts, max_tokens, hf_greedy_fresh(path, prompts, max_tokens)


def test_dynamic_reads_and_extends_the_context(dynamic_case):
    path = dynamic_case[0]
    cfg = read_model_config(path)
    assert cfg.rope.rope_type == "dynamic" and cfg.rope.original_max_position_embeddings == ORIGINAL
    assert cfg.max_model_len == 4 * ORIGINAL


@pytest.mark.parametrize("engine_args", [
    dict(num_kv_blocks=64),                                    # whole prompts, all at once
    dict(num_kv_blocks=64, max_num_batched_tokens=24),         # prompts chunked
    dict(num_kv_blocks=20, max_num_batched_tokens=256),        # pool runs dry: recompute preemption
], ids=["roomy", "chunked", "preempted"])
def test_dynamic_matches_hf_whatever_the_scheduler_did(dynamic_case, engine_args):
    path, prompts, max_tokens, ref = dynamic_case
    llm = make_llm(path, enable_prefix_caching=True, **engine_args)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    if engine_args["num_kv_blocks"] == 20:
        assert llm.engine.scheduler.total_preemptions > 0
    if engine_args.get("max_num_batched_tokens") == 24:
        assert llm.engine.scheduler.total_partial_prefills > 0
    assert_same(got, ref)


def test_dynamic_prefix_cache_keys_include_the_long_prompt_length(dynamic_case):
    """Prompts 3 and 4 share 80 tokens, but each is rotated with a base grown for its own
    length: serving one's cached K to the other would be wrong. Run one after the other,
    so the second could hit the first's blocks."""
    path, prompts, max_tokens, ref = dynamic_case
    llm = make_llm(path, num_kv_blocks=64, enable_prefix_caching=True)
    kv = llm.engine.kv_cache_manager

    def run_alone(i):
        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        assert llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0].token_ids == ref[i], f"prompt {i}"

    run_alone(2)
    run_alone(3)
    assert kv.prefix_hits == 0
    # a prompt within the original length is rotated the same whatever its length: repeats share
    run_alone(1)
    run_alone(1)
    assert kv.prefix_hits > 0


# -- the cos/sin table (static types) ------------------------------------------------------

TABLE_ROWS = 300  # the engine's max_model_len in these tests


def rope_of(name: str):
    case = CASES[name]
    return read_rope_config({"rope_parameters": dict(case["rope_parameters"])}, case["max_pos"])


def step_positions() -> list[torch.Tensor]:
    """Positions as steps bring them: one decode token (first row, last row), a prompt chunk,
    a batch of decodes in no order with a repeat, the whole table, none, and positions past
    the table (alone and among others), which the per-step computation must serve."""
    gen = torch.Generator().manual_seed(1)
    return [torch.tensor([0]), torch.tensor([TABLE_ROWS - 1]), torch.arange(37, 90),
            torch.cat([torch.randint(0, TABLE_ROWS, (31,), generator=gen), torch.tensor([7, 7])]),
            torch.arange(TABLE_ROWS), torch.zeros(0, dtype=torch.int64),
            torch.tensor([TABLE_ROWS]), torch.tensor([120, TABLE_ROWS + 5, 3]), torch.arange(250, 1000)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    same_kind = a.dtype == b.dtype and a.shape == b.shape
    return same_kind and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


@pytest.mark.parametrize("head_dim", [18, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_table_rows_equal_the_per_step_computation(name, dtype, head_dim):
    """Every static type: cos/sin read from the table equal, bit for bit, what the per-step
    computation gives for the same positions, at one and two threads, including positions
    past the table (served by that computation)."""
    rope = rope_of(name)
    tabled = RotaryEmbedding(rope, head_dim, dtype, "cpu", max_positions=TABLE_ROWS)
    per_step = RotaryEmbedding(rope, head_dim, dtype, "cpu")
    assert tabled.cos_sin_table is not None and tabled.cos_sin_table.shape == (TABLE_ROWS, 2, 1, head_dim)
    assert per_step.cos_sin_table is None
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for positions in step_positions():
                (cos, sin), (want_cos, want_sin) = tabled(positions), per_step(positions)
                assert same_bits(cos, want_cos) and same_bits(sin, want_sin), (threads, positions[:5])
    finally:
        torch.set_num_threads(before)


def test_dynamic_has_no_table():
    params = {"rope_type": "dynamic", "rope_theta": 20000.0, "factor": 4.0}
    rope = read_rope_config({"rope_parameters": params}, ORIGINAL)
    assert RotaryEmbedding(rope, 64, torch.float32, "cpu", max_positions=TABLE_ROWS).cos_sin_table is None


def test_engine_tables_max_model_len_not_max_position_embeddings(tmp_path):
    """The model gets the engine's max_model_len: a 512-position checkpoint served at 100
    keeps a 100-row table, and its greedy output is still HF's."""
    path = checkpoint(tmp_path / "llama3", "llama3")
    prompts, max_tokens = workload(shapes=[(5, 40), (50, 20)])
    llm = make_llm(path, max_model_len=100, num_kv_blocks=64)
    assert llm.engine.executor.model.rotary.cos_sin_table.shape[0] == 100
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_same(got, hf_greedy(path, prompts, max_tokens))
