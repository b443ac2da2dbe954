"""config.json of the MoE and MLA architectures: every field of HF's Mixtral, Qwen2-MoE and
DeepSeek-V3 config classes is classified, refusals name their field, and the honoured
fields that change the layer layout or the math (sparse steps, dense-only layers, top-k
renormalisation, no q LoRA, attention biases, halves RoPE, yarn's softmax scale, a Mixtral
window) run token for token like HF transformers."""
from __future__ import annotations

import random

import pytest
import torch

from checkpoints import MOE_DEFAULTS, HFGreedyReference, make_checkpoint, saved_hf_config
from checkpoints import read_config_dict as read
from pagedserve import LLM, SamplingParams
from pagedserve.model.config import HONOURED, IGNORED, REFUSED, field_group, read_model_config

HF_CONFIG_CLASSES = {"MixtralForCausalLM": "MixtralConfig", "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
                     "DeepseekV3ForCausalLM": "DeepseekV3Config"}
ARCH_KEYS = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
             "DeepseekV3ForCausalLM": "deepseek_v3"}
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def saved_config(arch: str, tmp_path, **overrides) -> dict:
    fields = {**SMALL, **MOE_DEFAULTS.get(ARCH_KEYS[arch], {}), **overrides}
    if arch == "DeepseekV3ForCausalLM":
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return saved_hf_config(arch, HF_CONFIG_CLASSES[arch], tmp_path, fields)


# The published DeepSeek-V3 config.json carries DeepSeek's own (remote-code) fields too.
DEEPSEEK_HUB_EXTRAS = {"aux_loss_alpha": 0.001, "ep_size": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid",
                       "seq_aux": True, "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
                       "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}


@pytest.mark.parametrize("arch", list(HF_CONFIG_CLASSES))
def test_every_field_of_the_hf_config_class_is_classified(arch):
    import transformers

    fields = set(getattr(transformers, HF_CONFIG_CLASSES[arch])().to_dict())
    if arch == "DeepseekV3ForCausalLM":
        fields |= set(DEEPSEEK_HUB_EXTRAS)
    unclassified = sorted(f for f in fields if field_group(arch, f) is None)
    assert not unclassified, f"{arch}: fields with no honoured/ignored/refused entry: {unclassified}"
    assert all(field_group(arch, f)[0] in (HONOURED, IGNORED, REFUSED) for f in fields)


def test_saved_configs_load_with_their_routing_rules(tmp_path):
    mixtral = read(tmp_path, saved_config("MixtralForCausalLM", tmp_path, num_local_experts=4))
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.scoring, mixtral.moe.renormalize) == \
        (4, 2, "softmax", True)
    assert mixtral.moe.sparse_layers == (True, True) and mixtral.mla is None
    qwen = read(tmp_path, saved_config("Qwen2MoeForCausalLM", tmp_path, decoder_sparse_step=2))
    assert qwen.moe.sparse_layers == (False, True) and qwen.moe.shared_gate and qwen.qkv_bias
    assert not qwen.moe.renormalize and qwen.moe.intermediate_size == 32
    ds = read(tmp_path, {**saved_config("DeepseekV3ForCausalLM", tmp_path), **DEEPSEEK_HUB_EXTRAS})
    assert ds.moe.scoring == "sigmoid" and ds.moe.correction_bias and ds.moe.routed_scaling_factor == 2.5
    assert (ds.moe.num_groups, ds.moe.topk_groups, ds.moe.sparse_layers) == (4, 2, (False, True))
    assert ds.moe.shared_intermediate_size == 32 and ds.mla.cache_width == 32 + 8
    assert ds.mla.softmax_scale == pytest.approx((16 + 8) ** -0.5)
    assert ds.kv_cache_shape(64) == (2, 1, 64, 1, 40)


def _set(**fields):
    return lambda cfg: cfg.update(fields)


REFUSALS = [
    ("DeepseekV3ForCausalLM", _set(scoring_func="softmax"), "scoring_func"),
    ("DeepseekV3ForCausalLM", _set(topk_method="greedy"), "topk_method"),
    ("DeepseekV3ForCausalLM", _set(moe_layer_freq=2), "moe_layer_freq"),
    ("DeepseekV3ForCausalLM", _set(num_key_value_heads=2), "num_key_value_heads"),
    ("DeepseekV3ForCausalLM", _set(n_group=3), "n_group"),
    ("DeepseekV3ForCausalLM", _set(topk_group=5), "topk_group"),
    ("DeepseekV3ForCausalLM", _set(n_group=8, topk_group=1), "n_group"),   # groups of 1: no top-2
    ("DeepseekV3ForCausalLM", _set(num_experts_per_tok=6, topk_group=1), "num_experts_per_tok"),
    ("DeepseekV3ForCausalLM", _set(qk_rope_head_dim=7), "qk_rope_head_dim"),
    ("DeepseekV3ForCausalLM", _set(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("MixtralForCausalLM", _set(num_experts_per_tok=9), "num_experts_per_tok"),
    ("MixtralForCausalLM", _set(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("MixtralForCausalLM", _set(use_qk_norm=True), "use_qk_norm"),
    ("Qwen2MoeForCausalLM", _set(mlp_only_layers="0"), "mlp_only_layers"),
    ("Qwen2MoeForCausalLM", _set(norm_topk_prob="yes"), "norm_topk_prob"),
    ("Qwen2MoeForCausalLM", _set(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                                 layer_types=None), "layer_types"),
    ("Qwen2MoeForCausalLM", _set(rope_interleave=True), "rope_interleave"),
]


@pytest.mark.parametrize("arch,edit,named", REFUSALS, ids=[f"{a[:6]}-{n}-{i}" for i, (a, _, n) in enumerate(REFUSALS)])
def test_unimplemented_values_refuse_the_load_naming_the_field(tmp_path, arch, edit, named):
    cfg = saved_config(arch, tmp_path)
    edit(cfg)
    with pytest.raises(ValueError) as err:
        read(tmp_path, cfg)
    assert str(err.value).startswith("model: ") and named in str(err.value), str(err.value)


# -- honoured fields run like HF ----------------------------------------------------------

def _randomize(path, suffixes: tuple[str, ...], seed: int = 0) -> None:
    """HF initialises these (biases) to zero; make them matter."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith(suffixes):
            tensors[name] = torch.randn(tensor.shape, generator=gen) * 0.08
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _parity(path, lengths=(1, 9, 40, 70), max_tokens=12, **engine_args):
    rng = random.Random(len(lengths))
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in lengths]
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=32, max_num_batched_tokens=32, **engine_args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    ref = HFGreedyReference(path)
    for prompt, out in zip(prompts, outs):
        assert ref.first_divergence(prompt, out.outputs[0].token_ids) is None


HONOURED_VARIANTS = {
    # dense layer 0 by step, dense layer 2 by mlp_only_layers, renormalised top-k
    "qwen2_moe-sparse-step-and-dense-layers": ("qwen2_moe", dict(layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                                                 norm_topk_prob=True), ()),
    "qwen2_moe-no-qkv-bias-no-shared-expert": ("qwen2_moe", dict(qkv_bias=False, shared_expert_intermediate_size=0),
                                               ()),
    "deepseek-no-q-lora-biases-halves-rope": ("deepseek_v3", dict(q_lora_rank=None, attention_bias=True,
                                                                  rope_interleave=False, first_k_dense_replace=0),
                                              ("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias")),
    "deepseek-yarn-softmax-scale-no-renorm": ("deepseek_v3", dict(
        norm_topk_prob=False, max_pos=256, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}), ()),
    "mixtral-sliding-window": ("mixtral", dict(sliding_window=24), ()),
    "deepseek-no-shared-experts-one-group": ("deepseek_v3", dict(n_shared_experts=0, n_group=1, topk_group=1), ()),
}


@pytest.mark.parametrize("variant", list(HONOURED_VARIANTS))
def test_honoured_fields_match_hf(tmp_path, variant):
    arch, fields, random_biases = HONOURED_VARIANTS[variant]
    path = make_checkpoint(tmp_path, arch, **fields)
    if random_biases:
        _randomize(path, random_biases)
    cfg = read_model_config(path)
    if variant.startswith("qwen2_moe-sparse"):
        assert cfg.moe.sparse_layers == (False, True, False, False)
    if variant.startswith("deepseek-yarn"):
        assert cfg.mla.softmax_scale > (16 + 8) ** -0.5   # mscale(4, 1)^2 > 1
    _parity(path)
