"""The quantized KV cache (`kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2 / int8).

References, none of them the code under test:
- quantize / dequantize: torch's own float8 casts (x / scale -> float8 -> x scale) and the
  OCP rounding bounds (half a unit in the last place: 2^-4 relative for E4M3 normals, 2^-3 for
  E5M2, a fixed step below the normal range); int8 computed by hand in numpy (scale = amax / 127
  per token and head, round half to even);
- the CPU kernel's byte decoding: every finite byte against torch's cast;
- both attention backends over a quantized pool: attention by hand in float64 over the pool
  dequantized by torch's casts (decodes, prefill chunks, GQA / MHA / MQA, block tables with
  holes, windows, partitioned long contexts);
- pool size: the bytes per token worked out by hand, and `pagedserve plan` / the simulator;
- the whole engine: HF transformers on the same weights with K and V rounded the same way
  inside its attention (a registered attention function), token for token and logprob for
  logprob; and the plain HF model, from which a quantized cache must measurably differ.
"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from checkpoints import make_checkpoint
from test_attention_kernels import SHAPES, Step, hand_attention, kv_views, make_step
from pagedserve import LLM, SamplingParams
from pagedserve.attention import cpu as cpu_kernel
from pagedserve.attention import cpu_backend, torch_backend
from pagedserve.attention.kv_quant import FORMATS, QuantizedKVCache, dequantize, kv_format, quantize
from pagedserve.cli import main
from pagedserve.config import EngineConfig
from pagedserve.sim.cost_model import CostParams
from pagedserve.sim.simulator import build_deployment
from pagedserve.worker.model_runner import allocate_zeroed

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (mantissa bits, smallest normal) of each fp8 format: rounding to nearest is off by at most half
# a unit in the last place, 2^-(m+1) of the value for normals, half the subnormal step below.
FP8_SPEC = {"fp8_e4m3": (3, 2.0 ** -6), "fp8_e5m2": (2, 2.0 ** -14)}


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    cpu_kernel.load_kernel()


# -- (a) quantize / dequantize ------------------------------------------------------------------
def fp8_by_torch_cast(x: torch.Tensor, name: str, scale: float) -> torch.Tensor:
    """What a value reads back as: torch's rounding cast of x / scale, times scale."""
    limit = torch.finfo(FP8[name]).max
    return (x.double() / scale).clamp(-limit, limit).float().to(FP8[name]).double() * scale


def int8_by_hand(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) per token and head: scale = amax / 127 (1 for an all-zero head), codes
    round half to even, in float32 as the cache computes."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=-1)
    scales = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(x / scales[..., None]), -127, 127).astype(np.int8)
    return codes, scales


def spread_values(gen: torch.Generator, shape=(64, 4, 32)) -> torch.Tensor:
    """Values over many binades, both signs, some exact zeros and a whole zero head."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 6, shape, generator=gen).float())
    x[0, 0, :5] = 0.0
    x[1, 1] = 0.0
    return x


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_fp8_round_trip_is_torchs_cast_within_half_an_ulp(name, scale):
    fmt = FORMATS[name]
    x = spread_values(torch.Generator().manual_seed(0))
    codes, scales = quantize(x, fmt, scale)
    assert scales is None and codes.dtype == torch.uint8 and codes.shape == x.shape
    got = dequantize(codes, None, fmt, scale, torch.float64)
    want = fp8_by_torch_cast(x, name, scale)
    assert torch.equal(got, want)
    mantissa_bits, smallest_normal = FP8_SPEC[name]
    subnormal_step = smallest_normal * 2.0 ** -mantissa_bits
    bound = torch.maximum(x.double().abs() * 2.0 ** -(mantissa_bits + 1), torch.tensor(subnormal_step / 2 * scale))
    in_range = x.double().abs() / scale <= fmt.max_value
    assert in_range.float().mean() > 0.9
    assert ((got - x.double()).abs() <= bound)[in_range].all()
    assert torch.equal(got[~in_range], x.double()[~in_range].sign() * fmt.max_value * scale)  # saturated


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_saturates_at_its_largest_value_instead_of_nan(name):
    fmt = FORMATS[name]
    x = torch.tensor([1e9, -1e9, fmt.max_value * 2.02, float(2 ** 40)])  # all past max x scale 2
    got = dequantize(*quantize(x, fmt, 2.0), fmt, 2.0, torch.float32)
    assert torch.equal(got, torch.tensor([1, -1, 1, 1]) * fmt.max_value * 2.0)


def test_int8_round_trip_matches_the_hand_computation():
    fmt = FORMATS["int8"]
    x = spread_values(torch.Generator().manual_seed(1))
    codes, scales = quantize(x, fmt)
    want_codes, want_scales = int8_by_hand(x.numpy())
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    got = dequantize(codes, scales, fmt, 1.0, torch.float64)
    # Off by at most half a step of each head's own scale; each head's largest value is exact to fp32.
    assert ((got - x.double()).abs() <= scales.double()[..., None] / 2 * (1 + 1e-6)).all()
    assert (got[1, 1] == 0).all() and (got[0, 0, :5] == 0).all()


def test_fp8_alias_and_formats():
    assert kv_format("fp8") is FORMATS["fp8_e4m3"] and kv_format(None) is None and kv_format("float32") is None


# -- (a') the kernel decodes every finite byte as torch does ------------------------------------
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_kernel_decodes_every_finite_fp8_byte_like_torch(name):
    """16 decodes of context 1, each on its own block: softmax over one key is exactly 1, so
    the kernel's output row is its decoding of the bytes stored for that token's V."""
    fmt, head_dim, block_size = FORMATS[name], 16, 16
    decoded = torch.arange(256, dtype=torch.uint8).view(FP8[name]).float()
    finite = torch.isfinite(decoded)
    v_values = torch.where(finite, decoded, torch.zeros(())).view(16, 1, head_dim)  # byte b at row b//16
    pool = QuantizedKVCache.allocate((1, 2, 16 * block_size, 1, head_dim), fmt, torch.device("cpu"), allocate_zeroed)
    v_scale = 0.5
    pool.set_tensor_scales([1.0], [v_scale])
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    step = Step(decodes=[(np.array([i]), 0) for i in range(16)], prefills=[])
    meta, _ = cpu_backend.build_metadata(step.decodes, step.prefills, block_size, None, torch.device("cpu"))
    q = torch.ones(16, 1, head_dim)
    k = torch.zeros(16, 1, head_dim)
    out = cpu_backend.paged_attention(q, k, v_values * v_scale, k_cache, v_cache, meta, 1.0)
    stored = v_cache.values.view(16, block_size, head_dim)[:, 0]
    # each finite byte round-trips through quantize (a non-finite one's slot got 0.0, byte 0)
    assert torch.equal(stored.reshape(256), torch.where(finite, torch.arange(256), 0).to(torch.uint8))
    assert torch.equal(out.view(256)[finite], decoded[finite] * v_scale)


# -- (b) both backends over a quantized pool, against attention by hand ------------------------
def noisy_quantized_pool(name: str, num_slots: int, kv_heads: int, head_dim: int, gen: torch.Generator,
                         k_scale: float, v_scale: float) -> QuantizedKVCache:
    """Every slot holds some valid quantized value (and scale), so a stray read shows."""
    fmt = FORMATS[name]
    pool = QuantizedKVCache.allocate((1, 2, num_slots, kv_heads, head_dim), fmt, torch.device("cpu"),
                                     allocate_zeroed)
    if fmt.per_token_scales:
        pool.values.copy_(torch.randint(-127, 128, pool.values.shape, generator=gen, dtype=torch.int8))
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=gen) * 0.05 + 0.001)
    else:
        pool.set_tensor_scales([k_scale], [v_scale])
        noise = torch.randn(pool.values.shape, generator=gen)
        pool.values.copy_(noise.to(FP8[name]).view(torch.uint8))  # randn never reaches NaN codes
    return pool


def clone_pool(pool: QuantizedKVCache) -> QuantizedKVCache:
    copy = QuantizedKVCache(pool.values.clone(), None if pool.scales is None else pool.scales.clone(), pool.fmt)
    copy.tensor_scales = [list(s) for s in pool.tensor_scales]
    return copy


def dequantized_by_hand(pool: QuantizedKVCache, which: int) -> torch.Tensor:
    """One of the pool's K (0) / V (1) as float64, by torch's cast or the int8 scales."""
    values = pool.values[0, which]
    if pool.fmt.per_token_scales:
        return values.double() * pool.scales[0, which].double()[..., None]
    return values.view(FP8[pool.fmt.name]).double() * pool.tensor_scales[0][which]


def stored_by_hand(pool: QuantizedKVCache, which: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bytes (and int8 scales) writing x must leave, computed without kv_quant."""
    if pool.fmt.per_token_scales:
        codes, scales = int8_by_hand(x.numpy())
        return torch.from_numpy(codes), torch.from_numpy(scales)
    limit = torch.finfo(FP8[pool.fmt.name]).max
    scaled = (x.double() / pool.tensor_scales[0][which]).clamp(-limit, limit).float()
    return scaled.to(FP8[pool.fmt.name]).view(torch.uint8), None


def check_quantized_step(step: Step, name: str, *, heads: int, kv_heads: int, head_dim: int, num_blocks: int,
                         block_size: int = 16, window: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pool = noisy_quantized_pool(name, num_blocks * block_size, kv_heads, head_dim, gen, k_scale=0.25, v_scale=2.0)
    q, k, v = kv_views(step.num_tokens, heads, kv_heads, head_dim, torch.float32, gen)
    scale = head_dim ** -0.5

    slots = []
    for first, rows, ctx, blocks in step.sequences():
        pos = np.arange(ctx - rows, ctx)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slots = torch.from_numpy(np.concatenate(slots))
    want_pool = clone_pool(pool)
    for which, x in ((0, k), (1, v)):
        codes, scales = stored_by_hand(pool, which, x.contiguous())
        want_pool.values[0, which][slots] = codes.view(want_pool.values.dtype)
        if scales is not None:
            want_pool.scales[0, which][slots] = scales
    want = hand_attention(q, dequantized_by_hand(want_pool, 0), dequantized_by_hand(want_pool, 1), step,
                          block_size, window, scale)

    for backend in (cpu_backend, torch_backend):
        got_pool = clone_pool(pool)
        meta, _ = backend.build_metadata(step.decodes, step.prefills, block_size, window, torch.device("cpu"))
        got = backend.paged_attention(q, k, v, got_pool[0, 0], got_pool[0, 1], meta, scale)
        assert torch.equal(got_pool.values, want_pool.values), backend.__name__  # the write, byte for byte
        if pool.scales is not None:
            assert torch.equal(got_pool.scales, want_pool.scales), backend.__name__
        assert got.dtype == torch.float32 and got.shape == q.shape
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{backend.__name__}: {m}")


QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("shape", ["gqa-64", "mqa-48", "gqa-16"])
def test_decodes_over_a_quantized_pool(name, shape):
    heads, kv_heads, head_dim = SHAPES[shape]
    step = make_step(np.random.default_rng(1), 300, 16, decode_ctx=[1, 2, 17, 33, 100, 250], prefill_spans=[])
    check_quantized_step(step, name, heads=heads, kv_heads=kv_heads, head_dim=head_dim, num_blocks=300)


@pytest.fixture(params=["routed", "kernel-only"])
def routing(request, monkeypatch):
    if request.param == "kernel-only":
        monkeypatch.setattr(cpu_backend, "KERNEL_MAX_FRESH_CHUNK", 1 << 30)
        monkeypatch.setattr(cpu_backend, "KERNEL_MAX_CACHED_CHUNK", 1 << 30)
    return request.param


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("window", [None, 24])
def test_prefills_and_decodes_over_a_quantized_pool(name, window, routing):
    """Fresh chunks (their own K/V must be read as stored), chunks after cached keys, decodes."""
    step = make_step(np.random.default_rng(3), 300, 16, decode_ctx=[5, 48, 129],
                     prefill_spans=[(0, 9), (0, 150), (16, 20), (37, 90), (5, 1)])
    check_quantized_step(step, name, heads=8, kv_heads=2, head_dim=64, num_blocks=300, window=window)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_long_quantized_contexts_split_across_threads(name):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        step = make_step(np.random.default_rng(6), 300, 16, decode_ctx=[2048, 1500], prefill_spans=[])
        check_quantized_step(step, name, heads=4, kv_heads=1, head_dim=64, num_blocks=300)
    finally:
        torch.set_num_threads(before)


# -- (c) the pool: plan's block count, at the quantized bytes per token -------------------------
BUDGET = 3_000_000
VALUES_PER_TOKEN = 2 * 2 * 2 * 16  # tiny_llama: K and V x 2 layers x 2 KV heads x head_dim 16
SCALE_BYTES_PER_TOKEN = {"fp8": 0, "fp8_e4m3": 0, "fp8_e5m2": 0, "int8": 2 * 2 * 2 * 4}  # int8: fp32 per head


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bf16"), "llama", dtype=torch.bfloat16)


def engine_pool(model_dir, dtype: str, kv_cache_dtype: str) -> tuple[int, int, str]:
    """(blocks, bytes the runner allocated for the pool, scales included, its value dtype)."""
    from pagedserve.engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                 kv_cache_memory=BUDGET, preemption_mode="recompute"))
    kv = engine.executor.kv_cache
    tensors = kv.tensors() if isinstance(kv, QuantizedKVCache) else [kv]
    values_dtype = str(tensors[0].dtype).removeprefix("torch.")
    return engine.block_pool.num_blocks, sum(t.numel() * t.element_size() for t in tensors), values_dtype


def planned(model_dir, dtype: str, kv_cache_dtype: str, capsys) -> dict:
    argv = ["plan", "--model", str(model_dir), "--device", "cpu", "--kv-cache-memory", str(BUDGET), "--json",
            "--kv-cache-dtype", kv_cache_dtype]
    if dtype != "auto":
        argv += ["--dtype", dtype]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["kv"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("model", ["fp32", "bf16-auto"])
def test_engine_pool_equals_plans_at_quantized_bytes(tiny_llama, bf16_llama, model, kv_cache_dtype, capsys):
    model_dir, dtype = (tiny_llama, "float32") if model == "fp32" else (bf16_llama, "auto")
    blocks, allocated, values_dtype = engine_pool(model_dir, dtype, kv_cache_dtype)
    per_block = 16 * (VALUES_PER_TOKEN + SCALE_BYTES_PER_TOKEN[kv_cache_dtype])  # one byte per value
    assert values_dtype == ("int8" if kv_cache_dtype == "int8" else "uint8")
    assert blocks == BUDGET // per_block and allocated == blocks * per_block <= BUDGET
    plan = planned(model_dir, dtype, kv_cache_dtype, capsys)
    assert (plan["num_blocks"], plan["bytes_per_block"]) == (blocks, per_block)
    cost = CostParams(peak_flops=1e12, mem_bandwidth=1e11, gemm_mfu=0.1, gemm_mbu=0.1, attn_mfu=0.1, attn_mbu=0.1)
    sim = build_deployment(EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=BUDGET),
                           str(model_dir), cost_params=cost)
    assert (sim.num_blocks, sim.bytes_per_block) == (blocks, per_block)


# -- (d) swap and prefix caching keep quantized blocks as they are -----------------------------
LENS = (40, 75, 110, 60, 95, 30)


def greedy_run(path, kv_cache_dtype: str, **engine_args):
    llm = LLM(str(path), max_model_len=128, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=1024,
              **engine_args)
    prompts = [[(i * 29 + 7 * n) % 380 + 2 for i in range(n)] for n in LENS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], dict(llm.engine.scheduler.total_preemptions_by_mode)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_swapped_quantized_blocks_come_back_unchanged(tiny_llama, kv_cache_dtype):
    roomy, preempted = greedy_run(tiny_llama, kv_cache_dtype, num_kv_blocks=512, enable_prefix_caching=False,
                                  preemption_mode="recompute")
    assert not any(preempted.values())
    swapped, preempted = greedy_run(tiny_llama, kv_cache_dtype, num_kv_blocks=8, preemption_mode="swap",
                                    swap_space="16MiB", enable_prefix_caching=False)
    assert preempted.get("swap", 0) > 0
    assert swapped == roomy


def test_block_copy_moves_values_and_int8_scales(tiny_llama):
    """The runner's block copy (swap out and in) over a quantized pool: each block's bytes and
    scales land at the destination block, nothing else changes."""
    from pagedserve.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_dtype="int8", num_kv_blocks=6, max_model_len=64,
                                 preemption_mode="swap", swap_space="1MiB"))
    runner = engine.executor
    gen = torch.Generator().manual_seed(0)
    device, host = runner.kv_cache, runner.host_cache
    device.values.copy_(torch.randint(-127, 128, device.values.shape, generator=gen, dtype=torch.int8))
    device.scales.copy_(torch.rand(device.scales.shape, generator=gen))
    before_values, before_scales = device.values.clone(), device.scales.clone()
    runner.copy_blocks([(1, 0), (4, 2)], device, host)
    runner.copy_blocks([(0, 5), (2, 3)], host, device)
    bs = runner.block_size

    def block(t, i):
        return t[:, :, i * bs:(i + 1) * bs]
    for src, dst in ((1, 5), (4, 3)):
        assert torch.equal(block(device.values, dst), block(before_values, src))
        assert torch.equal(block(device.scales, dst), block(before_scales, src))
    for untouched in (0, 1, 2, 4):
        assert torch.equal(block(device.values, untouched), block(before_values, untouched))
        assert torch.equal(block(device.scales, untouched), block(before_scales, untouched))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_prefix_hit_reads_the_same_quantized_bytes(tiny_llama, kv_cache_dtype):
    """A prompt whose first 64 tokens are a prefix hit (read back from the blocks another
    request wrote) samples with the logprobs it has when computed afresh: a fresh prefill reads
    its own K/V as stored, and the shared blocks hold the bytes the first request wrote."""
    prefix = [(i * 37) % 380 + 2 for i in range(64)]
    prompt = prefix + [5, 9, 11, 40, 41, 42, 100]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def run(enable_prefix_caching: bool):
        llm = LLM(str(tiny_llama), kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, max_model_len=128,
                  enable_prefix_caching=enable_prefix_caching, preemption_mode="recompute")
        llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        chosen = [step.logprob for step in out.logprobs]
        return out.token_ids, chosen, llm.engine.kv_cache_manager.prefix_hits

    fresh_tokens, fresh_logprobs, no_hits = run(False)
    shared_tokens, shared_logprobs, hits = run(True)
    assert no_hits == 0 and hits >= 64
    assert shared_tokens == fresh_tokens
    np.testing.assert_allclose(shared_logprobs, fresh_logprobs, atol=1e-5, rtol=0)


# -- (e) the engine against HF with K/V rounded the same way --------------------------------------
def hf_kv_rounding(name: str):
    """An HF attention function that rounds K and V (after RoPE) as the cache stores them, by
    torch's casts (fp8, per-tensor scale 1) or per token and head by hand (int8)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x: torch.Tensor) -> torch.Tensor:
        if name == "int8":
            amax = x.abs().amax(dim=-1, keepdim=True)
            s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            return torch.round(x / s).clamp(-127, 127) * s
        limit = torch.finfo(FP8[name]).max
        return x.clamp(-limit, limit).to(FP8[name]).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)
    return attention


def hf_model(path, kv_cache_dtype: str | None):
    import transformers
    from transformers import AttentionInterface

    attn = "sdpa"
    if kv_cache_dtype is not None:
        attn = f"pagedserve_kv_{kv_cache_dtype}"
        AttentionInterface.register(attn, hf_kv_rounding(kv_cache_dtype))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation=attn).eval()


def hf_greedy_prefix(model, prompt: list[int], output: list[int]) -> int:
    """How many of `output`'s tokens are the model's greedy choice, up to the first that is not."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        greedy = model(ids).logits[0, len(prompt) - 1:].argmax(dim=-1).tolist()
    return next((j for j, (a, b) in enumerate(zip(output, greedy)) if a != b), len(output))


def hf_prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "int8"])
def test_engine_matches_hf_with_the_same_kv_rounding(tiny_llama, kv_cache_dtype):
    """Criterion: against HF whose attention rounds K/V exactly as the cache stores them, every
    greedy token agrees and every teacher-forced logprob is within 1e-4 (fp32 noise); against
    plain HF the logprobs must differ by more than 1e-3 somewhere (the cache really rounds).
    The fp8 kinds map to e4m3 / e5m2 with scale 1 (vLLM's default without checkpoint scales)."""
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    prompts = [[(i * 31 + 11 * k) % 380 + 2 for i in range(8 + 9 * k)] for k in range(12)]
    llm = LLM(str(tiny_llama), kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256, preemption_mode="recompute")
    greedy = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    rounded_hf, plain_hf = hf_model(tiny_llama, name), hf_model(tiny_llama, None)
    for prompt, out in zip(prompts, greedy):
        tokens = out.outputs[0].token_ids
        assert hf_greedy_prefix(rounded_hf, prompt, tokens) == len(tokens)
    largest_vs_plain = 0.0
    for prompt, out in zip(prompts, scored):
        got = np.array([e.logprob for e in out.prompt_logprobs[1:]])
        np.testing.assert_allclose(got, hf_prompt_logprobs(rounded_hf, prompt), atol=1e-4, rtol=0)
        largest_vs_plain = max(largest_vs_plain, np.abs(got - hf_prompt_logprobs(plain_hf, prompt)).max())
    assert largest_vs_plain > 1e-3


# -- (f) bad values ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fp4", "FP8", "float16", "", None, 8])
def test_unknown_kv_cache_dtype_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=bad)


def test_unknown_kv_cache_dtype_on_the_command_lines(tiny_llama, capsys):
    for argv in (["plan", "--model", str(tiny_llama), "--device", "cpu", "--kv-cache-memory", "1MiB",
                  "--kv-cache-dtype", "fp4"],
                 ["serve", "--model", str(tiny_llama), "--kv-cache-dtype", "fp4"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "--kv-cache-dtype" in capsys.readouterr().err


def test_tensor_scales_refused_when_meaningless():
    pool = QuantizedKVCache.allocate((2, 2, 32, 1, 16), FORMATS["fp8_e4m3"], torch.device("cpu"), allocate_zeroed)
    with pytest.raises(ValueError, match="> 0"):
        pool.set_tensor_scales([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="per layer"):
        pool.set_tensor_scales([1.0], [1.0])
    pool.values[0, 0, 3] = 1
    with pytest.raises(ValueError, match="already holds values"):
        pool.set_tensor_scales([2.0, 2.0], [2.0, 2.0])
    assert pool.tensor_scales == [[1.0, 1.0], [1.0, 1.0]]  # nothing changed
    int8 = QuantizedKVCache.allocate((2, 2, 32, 1, 16), FORMATS["int8"], torch.device("cpu"), allocate_zeroed)
    with pytest.raises(ValueError, match="int8"):
        int8.set_tensor_scales([2.0, 2.0], [2.0, 2.0])


def test_sweeping_an_unknown_kv_cache_dtype_is_refused():
    from pagedserve.tune import tuner

    with pytest.raises(ValueError, match="fp4"):
        tuner.parse_sweep(["kv_cache_dtype=fp8,fp4"])


# -- (g) what the engine reports ----------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype,shown,bytes_per_token", [
    ("auto", "float32", 512), ("fp8", "fp8_e4m3", 128), ("int8", "int8", 160)])
def test_startup_log_and_metrics_name_the_dtype_and_bytes(tiny_llama, caplog, kv_cache_dtype, shown,
                                                          bytes_per_token):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.server.launcher import ServerThread, build_server

    caplog.set_level(logging.INFO, logger="pagedserve")
    app, _ = build_server(EngineConfig(model=str(tiny_llama), kv_cache_dtype=kv_cache_dtype, num_kv_blocks=8,
                                       max_model_len=128, preemption_mode="recompute"))
    assert f"KV cache dtype: {shown}, {bytes_per_token:,} bytes per token" in caplog.text
    with ServerThread(app) as server:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    info = families["pagedserve:cache_config_info"].samples
    assert [s.labels["cache_dtype"] for s in info] == [shown] and info[0].value == 1
    assert families["pagedserve:kv_cache_bytes_per_token"].samples[0].value == bytes_per_token


# -- accuracy on the built-in model ---------------------------------------------------------------
def test_agreement_counts_tokens_up_to_the_first_divergence():
    from pagedserve.bench.default_model_eval import agreement

    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == 4 / 6  # 2 + 2 of 6; the 4 after 9 not counted
    assert agreement([[1, 2]], [[1, 2]]) == 1.0


# Relative perplexity increase allowed over the unquantized cache: the aim for e4m3 (1%);
# e5m2 has one mantissa bit less; int8 keeps 8 bits with a scale per token and head. Measured
# on these windows (2026-11-30): +0.2%, +0.5%, -0.04%; a read off by 2x gives +60% or more.
PERPLEXITY_BOUNDS = {"fp8": 0.01, "fp8_e5m2": 0.02, "int8": 0.005}


def test_held_out_perplexity_of_the_built_in_model_with_quantized_kv():
    from pagedserve.bench.default_model_eval import held_out_windows, teacher_forced_perplexity
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR

    perplexity, windows = {}, None
    for kv_cache_dtype in ("auto", *PERPLEXITY_BOUNDS):
        # 64-token chunks: all but each window's first chunk read their keys back from the cache
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=80,
                  max_model_len=272, max_num_batched_tokens=64, preemption_mode="recompute")
        windows = windows or held_out_windows(llm.get_tokenizer(), 4, 256)
        result = teacher_forced_perplexity(llm, windows)
        assert result.num_tokens == 4 * 255
        perplexity[kv_cache_dtype] = result.value
    assert 10 < perplexity["auto"] < 100  # the trained model, not noise (training measured ~41)
    for kv_cache_dtype, bound in PERPLEXITY_BOUNDS.items():
        assert abs(perplexity[kv_cache_dtype] / perplexity["auto"] - 1) <= bound, (kv_cache_dtype, perplexity)


# -- the simulator's cost model and advise know the dtype -------------------------------------------
def test_cost_model_kv_bytes_and_dequantization_term_by_hand():
    from pagedserve.plan.kv_budget import ModelShape
    from pagedserve.sim.cost_model import CostModel, ModelCost, step_features

    # 2 layers, 1 KV head of head_dim 4: 16 K/V values per token
    shape = ModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=10)
    params = CostParams(peak_flops=1000.0, mem_bandwidth=100.0, gemm_mfu=1.0, gemm_mbu=1.0, attn_mfu=1.0,
                        attn_mbu=1.0, step_overhead_s=0.0, per_request_overhead_s=0.0, kv_dequant_s_per_value=0.01)
    # a 3-token prompt and a decode at context 10: 13 tokens of KV read, 208 values
    expected = {  # kv dtype: (bytes per token, attention seconds = KV bytes / 100, dequant = 208 x 0.01)
        "bfloat16": (32, 416 / 100, 0.0),
        "fp8": (16, max(1024 / 1000, 208 / 100), 2.08),
        "fp8_e5m2": (16, max(1024 / 1000, 208 / 100), 2.08),
        "int8": (32, 416 / 100, 2.08),  # 16 values + 4 scale bytes x 2 (K, V) x 2 layers
    }
    for kv_dtype, (bytes_per_token, attention, dequant) in expected.items():
        model = ModelCost.from_shape(shape, "bfloat16", kv_dtype, tp=1)
        assert model.kv_bytes_per_token == bytes_per_token, kv_dtype
        t = CostModel(model, params).breakdown(step_features(model, [3, 1], [3, 10]))
        assert t.attention == pytest.approx(attention) and t.dequant == pytest.approx(dequant), kv_dtype
        assert t.total == pytest.approx(t.linear + t.attention + t.allreduce + t.overhead + t.swap + dequant)
    # no measured figure: 2 ops per value on a fifteenth of the peak (vector units)
    default = CostParams(peak_flops=1500.0, mem_bandwidth=100.0, gemm_mfu=1.0, gemm_mbu=1.0, attn_mfu=1.0,
                         attn_mbu=1.0)
    model = ModelCost.from_shape(shape, "bfloat16", "fp8", tp=1)
    assert CostModel(model, default).breakdown(step_features(model, [1], [10])).dequant == pytest.approx(
        10 * 16 * 2 / (1500 / 15))


def _with_cache_dtype(text: str, cache_dtype: str | None, naming: str) -> str:
    if cache_dtype is None:
        return text
    prefix = "pagedserve:" if naming == "pagedserve" else "vllm:"
    return text + (f'# TYPE {prefix}cache_config_info gauge\n'
                   f'{prefix}cache_config_info{{model_name="my-model",cache_dtype="{cache_dtype}",'
                   f'block_size="16",num_blocks="100"}} 1.0\n')


@pytest.mark.parametrize("scenario", ["kv_pinned", "preemptions"])
@pytest.mark.parametrize("naming", ["pagedserve", "vllm"])
@pytest.mark.parametrize("cache_dtype, hinted", [(None, True), ("bfloat16", True), ("auto", True),
                                                 ("fp8_e4m3", False), ("int8", False), ("fp8", False)])
def test_kv_pressure_rules_name_an_8_bit_cache_unless_it_is_one(scenario, naming, cache_dtype, hinted):
    from pathlib import Path

    from pagedserve.bench.prom import parse_metrics
    from pagedserve.advise.advisor import Thresholds, advise, observe

    fixtures = Path(__file__).parent / "fixtures" / "metrics"
    a, b = (parse_metrics(_with_cache_dtype((fixtures / f"{scenario}.{naming}.{x}.txt").read_text(), cache_dtype,
                                            naming)) for x in "ab")
    t = Thresholds()
    report = advise(observe(a, b, [a, b], 30.0, t, gauges_sampled=False), t)
    finding = next(f for f in report.findings if f.rule == scenario)
    assert report.observations.kv_cache_dtype == cache_dtype
    assert ("--kv-cache-dtype fp8" in finding.action) == hinted
    if hinted and cache_dtype:
        assert f"the cache is {cache_dtype}" in finding.action


def test_tune_recommends_fp8_when_the_pool_binds(tmp_path, capsys):
    """A GPU preset with a 4 GiB pool: a bf16 cache holds 32 sequences of the workload's mean
    length, fp8 holds 64; at max_num_seqs 64 the bf16 pool preempts and fp8's does not."""
    out = tmp_path / "tune.json"
    assert main(["tune", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--workload", "random",
                 "--random-input-len", "512", "--random-output-len", "512", "--num-prompts", "120",
                 "--request-rate", "20", "--seed", "1", "--kv-cache-memory", "4GiB", "--max-model-len", "2048",
                 "--sweep", "kv_cache_dtype=auto,fp8", "--sweep", "max_num_seqs=64",
                 "--slo", "itl_p99:200", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {p["knobs"]["kv_cache_dtype"]: p for p in data["simulated"]}
    assert rows["auto"]["preemptions_per_request"] > 0.05 and rows["fp8"]["preemptions_per_request"] == 0
    assert rows["fp8"]["output_throughput"] > rows["auto"]["output_throughput"]
    assert data["chosen"] == {"kv_cache_dtype": "fp8", "max_num_seqs": 64}
    assert "--kv-cache-dtype fp8" in capsys.readouterr().out


# -- tensor parallelism: each rank's pool holds its heads at the quantized bytes ---------------------
def test_tp2_int8_ranks_allocate_plans_quantized_pool_and_score_as_tp1(tiny_llama):
    """tp=2 (gloo on CPU): each rank allocates the bytes `plan` gives for its share of the KV
    heads at int8's value and scale bytes, and teacher-forced prompt logprobs equal tp=1's with
    the same cache dtype (the ranks quantize their own heads the way one process does)."""
    from pagedserve.plan.budget import PlanRequest, compute_plan
    from pagedserve.plan.gpus import custom_gpu
    from pagedserve.plan.models import load_model

    budget = 400_000
    args = dict(kv_cache_dtype="int8", kv_cache_memory=budget, max_model_len=256, max_num_batched_tokens=64,
                preemption_mode="recompute")
    prompts = [[(i * 31 + 11 * k) % 380 + 2 for i in range(20 + 40 * k)] for k in range(5)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def scored(llm):
        return [np.array([e.logprob for e in o.prompt_logprobs[1:]]) for o in llm.generate(prompts, params,
                                                                                          use_tqdm=False)]
    want = scored(LLM(str(tiny_llama), **args))
    tp2 = LLM(str(tiny_llama), tensor_parallel_size=2, **args)
    try:
        plan = compute_plan(PlanRequest(model=load_model(str(tiny_llama)), device=custom_gpu(0, name="CPU"),
                                        device_kind="cpu", kv_cache_memory=budget, tensor_parallel_size=2,
                                        kv_cache_dtype="int8", block_size=16, max_model_len=256))
        # one of the two KV heads per rank: 16 values + a 4-byte scale, for K and V, 2 layers
        assert plan.kv_bytes_per_token == 2 * 2 * 1 * (16 + 4) == tp2.engine.pool_sizing.bytes_per_token
        assert tp2.engine.pool_sizing.num_blocks == plan.pool.num_blocks
        assert tp2.engine.executor.rank_kv_bytes == [plan.pool.num_bytes] * 2
        for got, ref in zip(scored(tp2), want):
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    finally:
        tp2.engine.shutdown()


def test_metrics_name_the_dtype_with_the_engine_core_in_another_process(tiny_llama):
    """A split server's front-end never holds the pool: the dtype and bytes come from the config,
    the block count from the core's first snapshot."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.server.launcher import ServerThread, build_server

    app, _ = build_server(EngineConfig(model=str(tiny_llama), kv_cache_dtype="int8", num_kv_blocks=8,
                                       max_model_len=128, preemption_mode="recompute"), engine_core_mode="process")
    with ServerThread(app) as server:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    info = families["pagedserve:cache_config_info"].samples
    assert [(s.labels["cache_dtype"], s.labels["num_blocks"]) for s in info] == [("int8", "8")]
    assert families["pagedserve:kv_cache_bytes_per_token"].samples[0].value == 160
# -- the torch path is device-generic (it is what CUDA tensors go through) ---------------------------
@pytest.mark.parametrize("name", QUANTIZED)
def test_torch_path_runs_on_a_non_cpu_device(name):
    """No CUDA here: the `meta` device (shapes, dtypes and devices, no values) catches any op in
    the quantize / write / gather / dequantize path that makes or needs a CPU tensor."""
    device = torch.device("meta")
    pool = QuantizedKVCache.allocate((1, 2, 64 * 16, 2, 16), FORMATS[name], device, allocate_zeroed)
    assert all(t.device == device for t in pool.tensors())
    decodes, prefills = [(np.array([3, 5]), 20)], [(np.array([7, 9]), 0, 20), (np.array([1, 2, 4]), 16, 10)]
    meta, _ = torch_backend.build_metadata(decodes, prefills, 16, None, device)
    q = torch.randn(31, 4, 16, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(31, 2, 16, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch_backend.paged_attention(q, k, v, pool[0, 0], pool[0, 1], meta, 0.25)
    assert (out.shape, out.dtype, out.device) == (q.shape, torch.bfloat16, device)


# -- CUDA's Triton kernels read plain caches only: a quantized one goes to the torch reference -------
@pytest.fixture
def fresh_backend_choice(monkeypatch):
    from pagedserve import attention

    attention.backend_for.cache_clear()
    attention._torch_for_quantized_cache.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    attention.backend_for.cache_clear()
    attention._torch_for_quantized_cache.cache_clear()


def test_where_triton_serves_a_quantized_cache_is_read_by_the_torch_reference(fresh_backend_choice, tiny_llama,
                                                                           caplog):
    """As `auto` picks Triton for CUDA tensors (simulated here on CPU): plain caches keep Triton's
    metadata, a quantized one gets the torch reference's, with one warning, and the engine's
    greedy tokens equal the CPU kernel's on the same cache dtype."""
    from pagedserve import attention
    from pagedserve.attention.torch_backend import AttentionMetadata as TorchMetadata
    from pagedserve.attention.triton_backend import TritonMetadata

    prompts = [[(i * 31 + 11 * k) % 380 + 2 for i in range(8 + 9 * k)] for k in range(6)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    args = dict(kv_cache_dtype="fp8", num_kv_blocks=64, max_model_len=256, preemption_mode="recompute")
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **args).generate(prompts, greedy, use_tqdm=False)]

    fresh_backend_choice.setenv(attention.BACKEND_ENV, "auto")
    fresh_backend_choice.setattr(attention, "backend_for", lambda device_type: "triton")
    step = ([(np.array([0, 1]), 20)], [(np.array([2, 3]), 0, 20)])
    assert type(attention.build_metadata(*step, 16, None, torch.device("cpu"))[0]) is TritonMetadata
    with caplog.at_level(logging.WARNING, logger="pagedserve.attention"):
        meta, _ = attention.build_metadata(*step, 16, None, torch.device("cpu"), quantized_cache=True)
        assert type(meta) is TorchMetadata
        got = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **args).generate(prompts, greedy,
                                                                                    use_tqdm=False)]
    assert got == want
    warnings = [r for r in caplog.records if r.name == "pagedserve.attention"]
    assert len(warnings) == 1 and "torch reference" in warnings[0].getMessage()


def test_forced_triton_with_a_quantized_cache_is_refused_at_start_up(fresh_backend_choice, tiny_llama):
    from pagedserve import attention

    fresh_backend_choice.setenv(attention.BACKEND_ENV, "triton")  # the interpreter serves CPU tensors in tests
    assert attention.backend_for("cpu") == "triton"
    with pytest.raises(ValueError, match="kv_cache_dtype.*PAGEDSERVE_ATTENTION_BACKEND=triton"):
        LLM(str(tiny_llama), kv_cache_dtype="int8", num_kv_blocks=64, max_model_len=256)
