"""Linear methods against F.linear in fp32, the ISA probe, and the dtype rule on CPUs with and
without bf16 hardware (the probe is mocked: these must pass on AMD AVX2, AVX-512 without BF16,
and AMX machines alike)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from checkpoints import hf_greedy, make_checkpoint
from pagedserve import LLM, SamplingParams
from pagedserve.config import resolve_dtype
from pagedserve.cpu_isa import CpuFeatures, cpu_features, features_from_flags, parse_cpuinfo_flags
from pagedserve.model import layers
from pagedserve.model.layers import (LINEAR_METHODS, METHOD_ENV, PROBE_ROWS, Linear, choose_linear_methods,
                                     probe_methods, rule_method)

CPU = torch.device("cpu")
NO_BF16 = [CpuFeatures(avx2=True), CpuFeatures(avx2=True, avx512f=True)]  # AMD AVX2; AVX-512 without BF16
WITH_BF16 = [CpuFeatures(avx2=True, avx512f=True, avx512_bf16=True),
             CpuFeatures(avx2=True, avx512f=True, avx512_bf16=True, amx_bf16=True, amx_tile=True)]
# Tolerances against fp32 F.linear: fp32 methods differ only in summation order; bf16 methods see
# bf16-rounded inputs and weights (the reference gets the same rounded values) and round the output.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def method_dtype_cases():
    return [(name, dtype) for name in LINEAR_METHODS for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", method_dtype_cases())
@pytest.mark.parametrize("out_features,in_features,bias", [(37, 19, False), (96, 64, True), (64, 19, True),
                                                           (1536, 1024, False)])
def test_method_matches_fp32_linear(name, dtype, out_features, in_features, bias):
    method = LINEAR_METHODS[name]
    if not method.available(dtype, CPU):
        with pytest.raises(ValueError, match=METHOD_ENV):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(METHOD_ENV, name)
                choose_linear_methods([(out_features, in_features)], dtype, CPU)
        return
    if not method.supports((out_features, in_features)):
        # Forced, it is used for the shapes it can pack and the rule picks for the rest.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(METHOD_ENV, name)
            choice = choose_linear_methods([(out_features, in_features), (96, 64)], dtype, CPU)
        assert choice.methods[(out_features, in_features)] != name and choice.methods[(96, 64)] == name
        assert f"{out_features}x{in_features}" in choice.reason
        return
    gen = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(b)
    layer.use(method)
    wide = torch.randn(300, 2 * in_features, generator=gen).to(dtype)
    inputs = [wide[:m, :in_features] for m in (1, 3, 32, 257)]      # strided views, as split() gives
    inputs += [wide[:24, :in_features].contiguous().view(2, 12, in_features)]  # leading batch dims
    for x in inputs:
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        with torch.inference_mode():
            got = layer(x)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("name", [n for n in LINEAR_METHODS if n != "torch"])
def test_packing_replaces_the_plain_weight(name):
    """A packed layer holds one copy of its weight, not two, and refuses a second packing."""
    method = LINEAR_METHODS[name]
    if not method.available(torch.float32, CPU):  # a torch built without oneDNN: nothing to pack
        assert name == "onednn" and not torch.backends.mkldnn.is_available()
        return
    layer = Linear(64, 96)
    with torch.no_grad():
        layer.weight.normal_()
    layer.use(method)
    assert "weight" not in dict(layer.named_parameters())
    assert layer.weight.shape == (96, 64) or layer.weight.is_mkldnn or layer.weight.numel() == 96 * 64
    with pytest.raises(RuntimeError, match="packed once"):
        layer.use(method)


def fake_timer(seconds_by_method_and_m: dict[tuple[str, int], float]):
    def timer(method, x, packed):
        return seconds_by_method_and_m[(method.name, x.shape[0])]
    return timer


def test_probe_picks_the_lowest_summed_relative_time():
    """onednn is 1.5x slower at M=1 but 2x faster at 8 and 32: it wins on the summed ratios;
    a method 10% slower everywhere never wins."""
    times = {}
    for m in PROBE_ROWS:
        times[("torch", m)] = 1.0
        times[("torch-t", m)] = 1.1
        times[("onednn", m)] = 1.5 if m == 1 else 0.5
    winner, scores = probe_methods((64, 32), torch.float32, ["torch", "torch-t", "onednn"], fake_timer(times))
    assert winner == "onednn"
    assert scores["torch"] == pytest.approx(1 + 2 + 2)
    times.update({("onednn", m): 1.5 for m in PROBE_ROWS})
    assert probe_methods((64, 32), torch.float32, ["torch", "torch-t", "onednn"], fake_timer(times))[0] == "torch"


def test_probe_choice_is_per_shape_and_only_among_available_methods(monkeypatch):
    monkeypatch.setenv(METHOD_ENV, "probe")
    seen = set()

    def timer(method, x, packed):
        seen.add(method.name)
        wide = x.shape[1] == 256  # torch-t wins the K=256 shape, onednn the other
        return {"torch": 1.0, "torch-t": 0.5 if wide else 2.0, "onednn": 2.0 if wide else 0.5, "cpp": 3.0}[method.name]

    available = [n for n, m in LINEAR_METHODS.items() if m.available(torch.float32, CPU)]
    choice = choose_linear_methods([(512, 256), (256, 688)], torch.float32, CPU, timer=timer)
    assert seen == set(available)
    if "onednn" in available:
        assert choice.methods == {(512, 256): "torch-t", (256, 688): "onednn"}
    meta = torch.device("meta")  # off CPU: plain torch, no probe
    assert set(choose_linear_methods([(8, 8)], torch.float32, meta, timer=timer).methods.values()) == {"torch"}


def test_cpuinfo_flags_parse():
    text = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\nbogomips\t: 1\n"
    feats = features_from_flags(parse_cpuinfo_flags(text))
    assert feats == CpuFeatures(avx2=True, avx512f=True, avx512_bf16=True, amx_bf16=True, amx_tile=True)
    assert feats.fast_bf16
    amd_avx2 = features_from_flags(parse_cpuinfo_flags("flags : fpu sse4_2 avx avx2 fma\n"))
    assert amd_avx2 == CpuFeatures(avx2=True) and not amd_avx2.fast_bf16
    assert parse_cpuinfo_flags("processor : 0\n") == frozenset()


@pytest.mark.parametrize("features", NO_BF16)
def test_bfloat16_resolves_to_fp32_without_bf16_hardware(features, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve.config"):
        assert resolve_dtype("bfloat16", "bfloat16", "cpu", features) == "float32"
    assert any("computing in float32" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("features", WITH_BF16)
def test_bfloat16_kept_with_bf16_hardware(features):
    assert resolve_dtype("bfloat16", "float32", "cpu", features) == "bfloat16"
    assert resolve_dtype("float32", "bfloat16", "cpu", features) == "float32"


@pytest.mark.parametrize("features", NO_BF16 + WITH_BF16)
def test_auto_is_fp32_on_every_cpu(features):
    assert resolve_dtype("auto", "bfloat16", "cpu", features) == "float32"
    assert resolve_dtype("auto", "float32", "cpu", features) == "float32"
    assert resolve_dtype("auto", "bfloat16", "cuda", features) == "bfloat16"
    assert resolve_dtype("bfloat16", "float32", "cuda", NO_BF16[0]) == "bfloat16"  # the CPU's ISA is no matter on CUDA


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", hidden=64, layers=2, inter=160)
    prompts = [[5 + i, 17, 33 + 2 * i, 90, 12 + i] * (1 + i % 3) for i in range(6)]
    return path, prompts, hf_greedy(path, prompts, [12] * len(prompts))


def greedy(path, prompts, n, **kw):
    llm = LLM(str(path), max_model_len=256, kv_cache_memory="16MiB", **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_engine_without_bf16_hardware_runs_fp32(tiny, monkeypatch):
    """The real probe mocked to an AVX2 CPU: --dtype bfloat16 loads fp32 weights and KV cache."""
    import pagedserve.config as config

    monkeypatch.setattr(config, "cpu_features", lambda: NO_BF16[0])
    monkeypatch.setattr(layers, "cpu_features", lambda: NO_BF16[0])
    path, prompts, _ = tiny
    llm, _ = greedy(path, prompts[:1], 2, dtype="bfloat16")
    model = llm.engine.executor.model
    assert llm.engine.dtype == "float32"
    assert llm.engine.executor.kv_cache.dtype == torch.float32
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("name", list(LINEAR_METHODS))
def test_forced_method_is_token_identical_to_hf_fp32(tiny, monkeypatch, name):
    path, prompts, want = tiny
    if not LINEAR_METHODS[name].available(torch.float32, CPU):
        monkeypatch.setenv(METHOD_ENV, name)
        with pytest.raises(ValueError, match=METHOD_ENV):
            greedy(path, prompts, 1, dtype="float32")
        return
    monkeypatch.setenv(METHOD_ENV, name)
    llm, got = greedy(path, prompts, 12, dtype="float32")
    linears = [m for m in llm.engine.executor.model.modules() if isinstance(m, Linear)]
    assert {m.method.name for m in linears if LINEAR_METHODS[name].supports((m.out_features, m.in_features))} == {name}
    assert got == want


def test_rule_by_dtype_and_shape(monkeypatch):
    monkeypatch.delenv(METHOD_ENV, raising=False)
    names = [n for n, m in LINEAR_METHODS.items() if m.available(torch.float32, CPU)]
    choice = choose_linear_methods([(512, 256), (1536, 1024)], torch.float32, CPU)
    if "cpp" in names:
        assert choice.methods == {(512, 256): "cpp", (1536, 1024): "cpp"}
    elif "onednn" in names:
        assert choice.methods == {(512, 256): "torch-t", (1536, 1024): "onednn"}
    assert rule_method((1536, 1024), torch.float32, ["torch", "torch-t", "onednn", "cpp"]) == "cpp"
    assert rule_method((512, 256), torch.float32, ["torch", "torch-t", "onednn"]) == "torch-t"
    assert rule_method((1536, 1024), torch.float32, ["torch", "torch-t", "onednn"]) == "onednn"
    # bf16: our AVX512-BF16 kernel where it runs (faster than prepacked oneDNN at decode M),
    # oneDNN's AMX tiles where the CPU has them
    assert rule_method((1536, 1024), torch.bfloat16, ["torch", "torch-t", "onednn", "cpp"]) == "cpp"
    assert rule_method((1536, 1024), torch.bfloat16, ["torch", "torch-t", "onednn", "cpp"], amx=True) == "onednn"
    assert rule_method((1536, 1024), torch.bfloat16, ["torch", "torch-t", "onednn"]) == "onednn"
    assert rule_method((512, 256), torch.bfloat16, ["torch", "torch-t", "onednn"]) == "onednn"
    assert rule_method((512, 256), torch.float32, ["torch"]) == "torch"
    assert rule_method((512, 256), torch.float16, ["torch", "torch-t", "onednn"]) == "torch"


def test_bad_method_env_is_refused(monkeypatch):
    monkeypatch.setenv(METHOD_ENV, "fastest")
    with pytest.raises(ValueError, match=METHOD_ENV):
        choose_linear_methods([(8, 8)], torch.float32, CPU)


def test_bfloat16_engine_on_this_cpu(tiny):
    """Whatever this machine is: with bf16 hardware the engine computes in bf16 (weights, KV) and
    its first-token log-probabilities match HF's bf16 model; without it, it computes in fp32."""
    path, prompts, _ = tiny
    llm = LLM(str(path), max_model_len=256, kv_cache_memory="16MiB", dtype="bfloat16")
    want = torch.bfloat16 if cpu_features().fast_bf16 else torch.float32
    assert llm.engine.executor.kv_cache.dtype == want
    assert llm.engine.executor.model.layers[0].mlp.down_proj.weight.dtype == want
    if want == torch.float32:
        return
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            hf_logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        first = out.outputs[0].logprobs[0]
        assert first.token_id == int(hf_logprobs.argmax())
        for token_id, logprob in first.top:  # bf16 keeps ~3 significant digits: allow a few hundredths
            assert abs(logprob - hf_logprobs[token_id].item()) < 0.05 + 0.02 * abs(logprob)


def test_bfloat16_greedy_matches_hf_bf16(tmp_path):
    """--dtype bfloat16 on this CPU: with AVX512-BF16 (and no AMX) every linear layer runs our
    bf16 kernel, and each greedy token is HF bf16's argmax (teacher forced on our output)
    wherever HF's top two logits are more than two bf16 ulps apart (rounding alone can swap a
    closer pair). Weights at std 0.2, not the fixture's 0.08, so the logits are peaked enough
    that such near-ties are rare; they are counted, so the comparison is not vacuous."""
    features = cpu_features()
    if not features.fast_bf16:
        pytest.skip("no bf16 hardware: --dtype bfloat16 runs fp32 (test_engine_without_bf16_hardware_runs_fp32)")
    import transformers

    path = make_checkpoint(tmp_path, "llama", hidden=64, layers=2, inter=160, init_std=0.2)
    prompts = [[5 + i, 17, 33 + 2 * i, 90, 12 + i] * (1 + i % 3) for i in range(6)]
    llm, got = greedy(path, prompts, 12, dtype="bfloat16")
    linears = [m for m in llm.engine.executor.model.modules() if isinstance(m, Linear)]
    if features.avx512_bf16 and not (features.amx_bf16 and features.amx_tile):
        assert {m.method.name for m in linears} == {"cpp"}
        assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    compared = near_ties = 0
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1:].float()
        for j, token in enumerate(tokens):
            top2 = logits[j].topk(2).values
            ulp = 2.0 ** (torch.floor(torch.log2(top2[0].abs())).item() - 7)
            if top2[0] - top2[1] <= 2 * ulp:
                near_ties += 1
                continue
            compared += 1
            assert token == int(logits[j].argmax()), f"prompt {prompt}: token {j} is not HF bf16's greedy choice"
    assert near_ties <= compared // 8, (near_ties, compared)
