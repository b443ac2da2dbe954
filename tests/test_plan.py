"""`pagedserve plan`: the KV-cache memory budget. Pure Python, no torch."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.plan import cli
from pagedserve.plan.budget import PlanRequest, compute_plan
from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.kv_budget import (
    ModelShape,
    kv_bytes_per_token,
    kv_cache_log_lines,
    kv_replication,
    num_blocks_for_bytes,
    size_kv_pool,
)
from pagedserve.plan.models import MODEL_PRESETS, generic_model, load_model, param_count, weight_bytes
from pagedserve.utils import parse_bytes

GiB = 2**30
KiB = 2**10
REPO_ROOT = Path(__file__).resolve().parents[1]


def plan_json(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser(prog="pagedserve")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


# --- The source article's worked example --------------------------------------------------
# 60 layers, hidden 4096 (MHA), fp16 KV, TP 8: "60 x 2 x 512 x 2 ~ 0.12 MB" per token per GPU;
# a 30 GB pool holds "30 x 1024 / 0.12 ~ 250k tokens"; at a mean length of 2000 that is
# ~128 sequences, and the article's rule keeps a 20% margin -> ~100.

ARTICLE_MODEL = generic_model(num_layers=60, hidden_size=4096)


def test_article_kv_bytes_per_token():
    per_token = kv_bytes_per_token(ARTICLE_MODEL.shape, kv_dtype_bytes=2, tp=8)
    assert per_token == 60 * 2 * 512 * 2 == 122_880
    assert per_token / 1e6 == pytest.approx(0.12, abs=0.005)  # "≈ 0.12 MB"
    assert per_token / 2**20 == pytest.approx(0.12, abs=0.005)  # in MiB too (0.117)


def test_article_arithmetic_reproduced_exactly():
    # The article rounds the per-token size to 0.12 MiB and counts 30 x 1024 MiB of pool:
    article_per_token = int(0.12 * 2**20)
    tokens = num_blocks_for_bytes(30 * GiB, article_per_token, block_size=1)
    assert tokens == 256_000  # "约可存 25 万 token"
    assert tokens // 2000 == 128
    assert int(0.8 * tokens / 2000) == 102  # "100 多个", after the 20% margin


def test_article_example_through_the_planner(capsys):
    out = plan_json(capsys, "--layers", "60", "--hidden-size", "4096", "--dtype", "fp16", "-tp", "8",
                    "--kv-cache-memory", "30GiB", "--mean-seq-len", "2000", "--max-model-len", "4096")
    kv = out["kv"]
    assert kv["bytes_per_token_per_gpu"] == 122_880
    assert kv["bytes_per_token_all_gpus"] == 8 * 122_880
    # Exact bytes (not the rounded 0.12) give 262,144 tokens: within 5% of "≈250k".
    assert kv["num_tokens"] == 262_144
    assert kv["num_tokens"] == pytest.approx(250_000, rel=0.05)
    assert out["derived"]["concurrency_at_mean_seq_len"] == pytest.approx(128, rel=0.03)
    assert out["recommended"]["max_num_seqs"] == 104
    assert out["recommended"]["max_num_seqs"] == pytest.approx(100, rel=0.05)
    assert out["inputs"]["kv_cache_dtype"] == "float16"


# --- Published shapes ---------------------------------------------------------------------

def shape(name: str) -> ModelShape:
    return load_model(name).shape


def test_llama_70b_tp4_is_80_kib_per_gpu():
    s = shape("llama-3.1-70b")
    assert kv_bytes_per_token(s, 2, tp=4) == 80 * KiB
    assert kv_bytes_per_token(s, 2, tp=4) * 4 == 320 * KiB == kv_bytes_per_token(s, 2, tp=1)


def test_llama_8b_is_128_kib():
    assert kv_bytes_per_token(shape("llama-3.1-8b"), 2) == 128 * KiB


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_deepseek_v3_mla_is_68_6_kib_on_every_rank(tp):
    s = shape("deepseek-v3")
    assert s.is_mla
    assert kv_bytes_per_token(s, 2, tp=tp) == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(s, 2, tp=tp) / KiB == pytest.approx(68.6, abs=0.05)
    assert kv_replication(s, tp) == tp


def test_tp_larger_than_kv_heads_replicates():
    s = shape("llama-3.1-70b")  # 8 KV heads
    assert kv_bytes_per_token(s, 2, tp=16) == kv_bytes_per_token(s, 2, tp=8) == 2 * 80 * 1 * 128 * 2
    assert kv_replication(s, 16) == 2
    plan = compute_plan(PlanRequest(model=load_model("llama-3.1-70b"), device=get_gpu("H100-SXM"),
                                    tensor_parallel_size=16, max_model_len=8192))
    assert any("replicated" in w and "TP 16" in w for w in plan.warnings)


def test_fp8_kv_halves_the_bytes():
    s = shape("qwen2.5-7b")
    assert kv_bytes_per_token(s, 1) * 2 == kv_bytes_per_token(s, 2) == 2 * 28 * 4 * 128 * 2


@pytest.mark.parametrize("name,billions", [
    ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("qwen2.5-7b", 7.62),
    ("qwen2.5-72b", 72.71), ("mistral-7b", 7.25), ("deepseek-v3", 671.0),
])
def test_parameter_counts_match_published_sizes(name, billions):
    assert param_count(shape(name)) / 1e9 == pytest.approx(billions, rel=0.01)


def test_weight_bytes_by_dtype():
    s = shape("llama-3.1-8b")
    # vLLM logs "model weights take 14.96GiB" for Llama-3-8B in bf16 (PR #10511, below).
    assert weight_bytes(s, "bfloat16") / GiB == pytest.approx(14.96, abs=0.01)
    assert weight_bytes(s, "fp16") == weight_bytes(s, "bfloat16")
    # fp8 / int4 quantize the linear layers; embeddings and lm_head stay 16-bit.
    assert weight_bytes(s, "bfloat16") / 2 < weight_bytes(s, "fp8") < weight_bytes(s, "bfloat16") * 0.6
    assert weight_bytes(s, "int4") < weight_bytes(s, "fp8")


def test_local_config_json_matches_the_preset(tmp_path):
    cfg = dict(MODEL_PRESETS["llama-3.1-70b"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path)).shape == shape("llama-3.1-70b")
    assert load_model(str(tmp_path / "config.json")).shape == shape("llama-3.1-70b")


# --- A published vLLM start-up memory profile ------------------------------------------------
# https://github.com/vllm-project/vllm/pull/10511 (youkaichao, 2024-12-14), `vllm serve
# meta-llama/Meta-Llama-3-8B` on an H100:
#   total_gpu_memory 79.22GiB, gpu_memory_utilization 0.90, can use 71.29GiB,
#   model weights take 14.96GiB, non_torch_memory 1.79GiB,
#   PyTorch activation peak memory 1.26GiB, available_kv_cache_memory 53.29GiB

VLLM_KV_GIB = 53.29


def vllm_profile_request(**overrides) -> PlanRequest:
    fields = dict(model=load_model("meta-llama/Meta-Llama-3-8B"), device=get_gpu("H100-SXM"),
                  gpu_memory_utilization=0.90, activation_memory=int(1.26 * GiB),
                  overhead=int(1.79 * GiB), max_model_len=8192,
                  # the run's vLLM (V0 engine, 2024) sampled 256 seqs in its profile: EngineArgs'
                  # max_num_seqs default then, before the per-device defaults plan now takes
                  max_num_seqs=256)
    fields.update(overrides)
    return PlanRequest(**fields)


def test_reproduces_vllm_pr_10511_profile():
    # vLLM's measured activation peak already includes its dummy sampler run.
    plan = compute_plan(vllm_profile_request(sampler_memory=0))
    assert plan.request.device.memory_bytes / GiB == pytest.approx(79.22, abs=0.005)
    assert plan.parts[0].bytes / GiB == pytest.approx(14.96, abs=0.01)  # weights computed, not given
    assert plan.kv_pool_budget_bytes / GiB == pytest.approx(VLLM_KV_GIB, rel=0.02)
    assert plan.kv_pool_budget_bytes / GiB == pytest.approx(VLLM_KV_GIB, abs=0.02)
    vllm_blocks = int(VLLM_KV_GIB * GiB) // (128 * KiB * 16)
    assert plan.pool.num_blocks == pytest.approx(vllm_blocks, rel=0.02)


def test_vllm_profile_with_our_sampler_estimate_stays_within_2_percent():
    plan = compute_plan(vllm_profile_request())
    assert plan.kv_pool_budget_bytes / GiB == pytest.approx(VLLM_KV_GIB, rel=0.02)


def test_activation_estimate_is_in_the_measured_ballpark():
    # Estimate (activations + sampler) vs vLLM's measured 1.26 GiB at 8192 batched tokens.
    plan = compute_plan(vllm_profile_request(activation_memory=None, max_num_batched_tokens=8192))
    estimated = plan.parts[1].bytes + plan.parts[2].bytes
    assert estimated / GiB == pytest.approx(1.26, rel=0.10)


# --- Warnings -----------------------------------------------------------------------------

def test_warns_when_pool_cannot_hold_one_max_model_len_request():
    plan = compute_plan(PlanRequest(model=load_model("llama-3.1-8b"), device=get_gpu("RTX-4090"),
                                    max_model_len=131072))
    assert 0 < plan.pool.num_tokens < 131072
    assert any("fewer than one max_model_len" in w for w in plan.warnings)
    assert plan.largest_max_model_len == plan.pool.num_tokens


def test_warns_when_utilisation_leaves_no_room():
    plan = compute_plan(PlanRequest(model=load_model("llama-3.1-70b"), device=get_gpu("A100-80GB")))
    assert plan.pool.num_blocks == 0
    assert any("leaves no room" in w for w in plan.warnings)


def test_kv_cache_memory_override_and_oversubscription_warning():
    plan = compute_plan(PlanRequest(model=load_model("llama-3.1-8b"), device=get_gpu("RTX-4090"),
                                    kv_cache_memory=20 * GiB, max_model_len=8192))
    assert plan.kv_pool_budget_bytes == 20 * GiB
    assert any("exceed the device" in w for w in plan.warnings)


# --- One source of truth: the engine's CPU sizing -----------------------------------------

def test_cpu_plan_by_hand_and_its_log_lines(capsys):
    out = plan_json(capsys, "--model", "llama-3.1-8b", "--device", "cpu", "--kv-cache-memory", "4GiB",
                    "--max-model-len", "4096")
    # By hand: 32 layers x (K, V) x 8 KV heads x 128 x 4 bytes = 256 KiB per token: the CPU engine
    # computes a bf16 checkpoint in fp32 under dtype auto, and the plan sizes what the engine
    # allocates. (That the engine's real pool has the plan's size is checked in test_pool_sizing.py.)
    assert out["kv"]["num_blocks"] == 4 * GiB // (256 * KiB * 16) == 1024
    pool = size_kv_pool(ModelShape.from_hf_config(MODEL_PRESETS["llama-3.1-8b"]), parse_bytes("4GiB"),
                        kv_dtype_bytes=4, block_size=16)
    assert out["device"]["kind"] == "cpu"
    assert "--device cpu" in out["recommended"]["commands"]["pagedserve"]
    lines = kv_cache_log_lines(pool, 4096, device="CPU")
    assert lines[0].startswith("CPU KV cache size: 16,384 tokens")
    assert "4.00x" in lines[1] and "worst case" in lines[1]


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 2**40), per_token=st.integers(1, 2**20), block=st.sampled_from([1, 8, 16, 32]))
def test_pool_never_exceeds_its_budget(budget, per_token, block):
    blocks = num_blocks_for_bytes(budget, per_token, block)
    assert blocks * per_token * block <= budget < (blocks + 1) * per_token * block


# --- CLI ----------------------------------------------------------------------------------

def test_cli_json_for_a_preset(capsys):
    out = plan_json(capsys, "--model", "llama-3.1-70b", "-tp", "4", "--gpu", "H100-SXM",
                    "--max-model-len", "8192", "--mean-seq-len", "2000")
    assert out["kv"]["bytes_per_token_per_gpu"] == 80 * KiB
    parts = {p["part"]: p for p in out["memory_per_gpu"]}
    assert sum(p["bytes"] for p in out["memory_per_gpu"]) == out["device"]["memory_bytes"]
    assert parts["KV cache pool"]["bytes"] == out["kv"]["pool_budget_bytes"] > 0
    assert out["recommended"]["max_num_seqs"] == int(0.8 * out["derived"]["concurrency_at_mean_seq_len"])
    assert out["recommended"]["commands"]["vllm"].startswith("vllm serve meta-llama/Llama-3.1-70B")
    assert "--tensor-parallel-size 4" in out["recommended"]["commands"]["vllm"]


def test_cli_text_output_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "pagedserve.plan.cli", "--model", "qwen2.5-7b",
                           "--gpu", "L40S", "--kv-cache-dtype", "fp8"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "Where the memory goes" in proc.stdout
    assert "KV cache pool" in proc.stdout and "vllm serve" in proc.stdout


@pytest.mark.parametrize("argv,flag", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "llama-3.1-8b", "--gpu", "tpu-v9"], "unknown GPU"),
    (["--model", "llama-3.1-8b", "--device", "cpu"], "--kv-cache-memory"),
    (["--layers", "60"], "--heads"),
])
def test_cli_bad_values_exit_2_with_one_line(capsys, argv, flag):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,flag", [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory", "lots"], "--gpu-memory"),
    (["-tp", "0"], "--tensor-parallel-size"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
])
def test_cli_bad_flag_values_name_the_flag(capsys, argv, flag):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--model", "llama-3.1-8b", *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


# --- Byte sizes ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("30GB", 30 * 10**9), ("512MiB", 512 * 2**20), (123, 123), ("123", 123),
    ("1.5GiB", 3 * 2**29),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "four GiB", "-1GiB", None])
def test_parse_bytes_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_batch_defaults_follow_vllm_by_device_and_usage_context():
    """vLLM's EngineArgs defaults (vllm/engine/arg_utils.py): >= 70 GiB and not an A100 -> 8192 /
    1024 for the API server, 16384 / 1024 offline; A100 of any size and smaller GPUs -> 2048 / 256,
    8192 / 256 offline. `plan` and `simulate` on a preset take them when the user sets neither."""
    from pagedserve.plan.budget import vllm_batch_defaults

    def defaults(gpu, usage="server"):
        spec = get_gpu(gpu)
        return vllm_batch_defaults(spec.memory_bytes, spec.name, usage)

    assert defaults("A100-80GB") == (2048, 256) and defaults("A100-80GB", "offline") == (8192, 256)
    assert defaults("A100-40GB") == (2048, 256) and defaults("L4") == (2048, 256)
    for big in ("H100-SXM", "H200", "MI300X", "B200"):
        assert defaults(big) == (8192, 1024) and defaults(big, "offline") == (16384, 1024), big
    plan = compute_plan(PlanRequest(model=load_model("llama-3.1-8b"), device=get_gpu("A100-80GB"),
                                    max_model_len=8192))
    assert "2,048 batched tokens" in next(p.note for p in plan.parts if p.name.startswith("activation"))


def test_plan_sizes_the_sampler_at_vllms_default_seqs_unless_given():
    """The sampler / logits buffer is max_num_seqs rows (vLLM's profile run samples that many);
    unset, it is vLLM's default for the device (vllm_batch_defaults: 1,024 on an H100, 256 on an
    A100, capped at a smaller token budget the user gave), not a fixed 256."""
    from pagedserve.plan.budget import sampler_bytes

    model = load_model("llama-3.1-8b")
    for gpu, extra, seqs in (("H100-SXM", {}, 1024), ("A100-80GB", {}, 256), ("H100-SXM", {"max_num_seqs": 64}, 64),
                             ("H100-SXM", {"max_num_batched_tokens": 512}, 512)):
        plan = compute_plan(PlanRequest(model=model, device=get_gpu(gpu), max_model_len=8192, **extra))
        sampler = next(p for p in plan.parts if p.name.startswith("sampler"))
        assert plan.max_num_seqs_used == seqs, (gpu, extra)
        assert sampler.bytes == sampler_bytes(seqs, model.shape.vocab_size) and f"{seqs} seqs" in sampler.note


def test_simulate_on_a_preset_takes_vllms_defaults_unless_given(capsys):
    from pagedserve.cli import main

    base = ["simulate", "--model", "llama-3.1-8b", "--workload", "random", "--random-input-len", "64",
            "--random-output-len", "2", "--num-prompts", "2"]
    for gpu, extra, expect in (("A100-80GB", [], "max_num_seqs=256 max_num_batched_tokens=2048"),
                               ("H100-SXM", [], "max_num_seqs=1024 max_num_batched_tokens=8192"),
                               ("H100-SXM", ["--max-num-seqs", "64"], "max_num_seqs=64 max_num_batched_tokens=8192")):
        assert main(base + ["--gpu", gpu] + extra) == 0
        assert expect in capsys.readouterr().out, (gpu, extra)
