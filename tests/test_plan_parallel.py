"""`plan` under tensor, pipeline, data and expert parallelism, checked against hand
computations from the published configs and against the published parameter counts.

Sources of the figures:
- DeepSeek-V3: the HF config.json of deepseek-ai/DeepSeek-V3 (hidden 7168, 61 layers,
  first_k_dense_replace 3, 256 routed experts of width 2048 + 1 shared, 8 active, dense
  MLP width 18432, q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128, 128 heads,
  vocab 129280, fp8 linear layers), and the DeepSeek-V3 Technical Report (arXiv:2412.19437):
  671B total parameters, 37B activated per token (the multi-token-prediction module is
  counted apart).
- Mixtral 8x7B: the HF config.json of mistralai/Mixtral-8x7B-v0.1, and Mistral AI's
  "Mixtral of experts" (arXiv:2401.04088): 47B parameters, 13B active per token
  (the announcement gives 46.7B and 12.9B).
- Layer split under PP: vLLM's get_pp_indices (61 layers over 2 stages: 31 + 30).
"""
from __future__ import annotations

import json

import pytest

from pagedserve.plan import cli
from pagedserve.plan.budget import PlanRequest, compute_plan
from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.models import load_model, param_count, weight_bytes
from pagedserve.plan.parallel import ParallelLayout, active_params, stage_layer_counts, stage_weights

# DeepSeek-V3 by hand, from its config.json
H, LAYERS, DENSE, EXPERTS, INTER, MOE_INTER, VOCAB = 7168, 61, 3, 256, 18432, 2048, 129280
HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V = 128, 1536, 512, 64, 128, 128
MOE_LAYERS = LAYERS - DENSE
EXPERT = 3 * H * MOE_INTER                         # gate, up, down of one expert
ATTN_REPLICATED = H * Q_LORA + Q_LORA + H * (KV_LORA + ROPE) + KV_LORA   # q_a, kv_a (+ their norms)
ATTN_SHARDED = Q_LORA * HEADS * (NOPE + ROPE) + KV_LORA * HEADS * (NOPE + V) + HEADS * V * H  # q_b, kv_b, o
LATENT_BYTES_BF16 = (KV_LORA + ROPE) * 2           # one layer's cache entry per token


def deepseek_fp8_weights_per_gpu(tp: int, experts_per_gpu_share: float, layers: range, first: bool, last: bool,
                                 ) -> int:
    """Bytes on one GPU: linear layers fp8 (1 byte), embedding, head and norms bf16 (2 bytes).
    `experts_per_gpu_share`: routed-expert weights held per MoE layer, in experts."""
    linear = 0
    for layer in layers:
        linear += ATTN_REPLICATED + ATTN_SHARDED // tp
        if layer < DENSE:
            linear += 3 * H * INTER // tp
        else:
            # router (+ its e_score_correction_bias, in the checkpoint per MoE layer), shared, routed
            linear += H * EXPERTS + EXPERTS + EXPERT // tp + int(experts_per_gpu_share * EXPERT)
    bf16 = 2 * H * len(layers) + (H if last else 0) + (VOCAB * H // tp) * (int(first) + int(last))
    return linear + 2 * bf16


def plan_for(**layout):
    return compute_plan(PlanRequest(model=load_model("deepseek-v3"), device=get_gpu("H200"), max_model_len=32768,
                                    **layout))


def test_published_parameter_counts():
    ds = load_model("deepseek-v3").shape
    assert param_count(ds) / 1e9 == pytest.approx(671, rel=0.005)
    assert active_params(ds) / 1e9 == pytest.approx(37, rel=0.02)
    mixtral = load_model("mixtral-8x7b").shape
    assert param_count(mixtral) / 1e9 == pytest.approx(46.7, rel=0.005)
    assert active_params(mixtral) / 1e9 == pytest.approx(12.9, rel=0.01)


def test_one_gpu_layout_is_the_whole_model():
    shape = load_model("deepseek-v3").shape
    (only,) = stage_weights(shape, "fp8", ParallelLayout())
    assert only.weight_bytes == weight_bytes(shape, "fp8")
    assert only.kv_bytes_per_token == LAYERS * LATENT_BYTES_BF16 == 70_272


def test_deepseek_v3_on_8_h200_tp8_vs_tp8_ep8_vs_tp4_pp2():
    """The articles' question, answered with the planner's numbers and checked by hand."""
    tp8, tp8_ep8, tp4_pp2 = plan_for(tensor_parallel_size=8), \
        plan_for(tensor_parallel_size=8, enable_expert_parallel=True), \
        plan_for(tensor_parallel_size=4, pipeline_parallel_size=2)
    every_layer = range(LAYERS)
    # TP8: every GPU holds 1/8 of each of the 256 experts = 32 experts' worth
    assert tp8.parts[0].bytes == deepseek_fp8_weights_per_gpu(8, EXPERTS / 8, every_layer, True, True)
    # TP8+EP8 (DP 1): 32 whole experts per GPU -- the same bytes; EP changes traffic, not memory
    assert tp8_ep8.stages[0].routed_experts_per_gpu == 32
    assert tp8_ep8.parts[0].bytes == tp8.parts[0].bytes
    # TP4xPP2: stages of 31 and 30 layers; the second (30 MoE layers + LM head) is heavier
    assert stage_layer_counts(LAYERS, 2) == [31, 30] and stage_layer_counts(LAYERS, 4) == [15, 15, 16, 15]
    stage0, stage1 = tp4_pp2.stages
    assert stage0.weight_bytes == deepseek_fp8_weights_per_gpu(4, EXPERTS / 4, range(0, 31), True, False)
    assert stage1.weight_bytes == deepseek_fp8_weights_per_gpu(4, EXPERTS / 4, range(31, 61), False, True)
    assert tp4_pp2.binding_stage == 1 and tp4_pp2.parts[0].bytes == stage1.weight_bytes
    # KV per token per GPU: the MLA latent is whole on every TP rank; PP halves the layers
    assert tp8.kv_bytes_per_token == 61 * LATENT_BYTES_BF16
    assert (stage0.kv_bytes_per_token, stage1.kv_bytes_per_token) == (31 * LATENT_BYTES_BF16, 30 * LATENT_BYTES_BF16)
    # all three fit; TP4xPP2 holds more tokens: 2 GiB more weights per GPU, half the KV per token
    assert tp8.fits and tp8_ep8.fits and tp4_pp2.fits
    assert tp4_pp2.pool.num_tokens > 1.8 * tp8.pool.num_tokens
    # and in bf16 (1.34 TB) nothing on 8 GPUs fits
    bf16 = compute_plan(PlanRequest(model=load_model("deepseek-v3"), device=get_gpu("H200"), dtype="bfloat16",
                                    tensor_parallel_size=8, max_model_len=32768))
    assert not bf16.fits and any("do not fit" in w for w in bf16.warnings)


def test_ep_off_with_data_parallel_warns_and_ep_fits():
    """The articles' symptom row: experts pile onto every GPU when EP is off."""
    no_ep = plan_for(data_parallel_size=8)
    assert not no_ep.fits
    warning = next(w for w in no_ep.warnings if "--enable-expert-parallel" in w)
    assert "256 experts" in warning
    ep = plan_for(data_parallel_size=8, enable_expert_parallel=True)
    assert ep.fits and not any("experts do not fit" in w for w in ep.warnings)
    # DP8+EP8: attention and dense layers whole on each GPU, 32 whole experts per MoE layer
    assert ep.parts[0].bytes == deepseek_fp8_weights_per_gpu(1, EXPERTS / 8, range(LAYERS), True, True)


def test_mixtral_ep_splits_experts_whole():
    shape = load_model("mixtral-8x7b").shape
    tp2 = stage_weights(shape, "bfloat16", ParallelLayout(2))[0]
    dp2_ep = stage_weights(shape, "bfloat16", ParallelLayout(1, 1, 2, enable_expert_parallel=True))[0]
    expert = 3 * 4096 * 14336
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    # DP2+EP2: each GPU holds 4 whole experts per layer and the whole attention
    assert dp2_ep.params["mlp"] == 32 * (4 * expert + 4096 * 8)
    assert dp2_ep.params["attention"] == 32 * attention
    assert tp2.params["mlp"] == 32 * (8 * expert // 2 + 4096 * 8)
    assert tp2.params["attention"] == 32 * attention // 2


@pytest.mark.parametrize("argv,named", [
    (["--model", "deepseek-v3", "-tp", "8", "--expert-parallel-size", "4"], "--expert-parallel-size"),
    (["--model", "llama-3.1-8b", "--enable-expert-parallel"], "--enable-expert-parallel"),
    (["--model", "llama-3.1-8b", "-pp", "33"], "--pipeline-parallel-size"),
    (["--model", "llama-3.1-8b", "-dp", "0"], "--data-parallel-size"),
])
def test_bad_layouts_are_refused_by_name(capsys, argv, named):
    try:
        code = cli.main(argv)
    except SystemExit as exc:   # argparse's own refusals
        code = exc.code
    assert code == 2
    assert named in capsys.readouterr().err


def test_cli_reports_stages_and_recommends_vllm_flags(capsys):
    assert cli.main(["--model", "deepseek-v3", "--gpu", "H200", "-tp", "4", "-pp", "2", "--max-model-len", "32768",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["num_layers"] for s in out["parallel"]["stages"]] == [31, 30]
    assert out["parallel"]["layout"] == "TP4xPP2" and out["parallel"]["fits"]
    assert "--pipeline-parallel-size 2" in out["recommended"]["commands"]["vllm"]
    assert cli.main(["--model", "deepseek-v3", "--gpu", "H200", "-dp", "8", "--enable-expert-parallel",
                     "--max-model-len", "32768", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["expert_parallel_size"] == 8
    assert "--data-parallel-size 8 --enable-expert-parallel" in out["recommended"]["commands"]["vllm"]


def test_cli_compares_layouts_in_one_table(capsys):
    argv = ["--model", "deepseek-v3", "--gpu", "H200", "--max-model-len", "32768",
            "--layouts", "TP8,TP8+EP8,TP4xPP2,DP8"]
    assert cli.main(argv + ["--json"]) == 0
    plans = {p["parallel"]["layout"]: p for p in json.loads(capsys.readouterr().out)}
    assert [plans[k]["parallel"]["fits"] for k in ("TP8", "TP8+EP8", "TP4xPP2", "TP1xDP8")] == [True, True, True, False]
    assert plans["TP4xPP2"]["kv"]["bytes_per_token_per_gpu"] * 2 == plans["TP8"]["kv"]["bytes_per_token_per_gpu"] \
        - LATENT_BYTES_BF16
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "TP4xPP2" in text and "--enable-expert-parallel" in text   # the DP8 row's warning
    assert cli.main(argv[:-1] + ["TP8+EP4"]) == 2
    assert "--expert-parallel-size" in capsys.readouterr().err
