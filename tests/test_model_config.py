"""config.json handling: every field of HF's Llama/Qwen2/Mistral configs is classified, each
refusal names its field, and the fields honoured beyond RoPE (biases, sliding windows) run
token for token like HF transformers."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from checkpoints import hf_greedy, make_checkpoint, saved_hf_config
from checkpoints import read_config_dict as read
from pagedserve import LLM, SamplingParams
from pagedserve.model.config import HONOURED, IGNORED, REFUSED, field_group, read_model_config

HF_CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                     "MistralForCausalLM": "MistralConfig"}
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def saved_config(arch: str, tmp_path, **overrides) -> dict:
    """config.json exactly as the installed transformers saves it for this architecture."""
    return saved_hf_config(arch, HF_CONFIG_CLASSES[arch], tmp_path, {**SMALL, **overrides})


@pytest.mark.parametrize("arch", list(HF_CONFIG_CLASSES))
def test_every_field_of_the_hf_config_class_is_classified(arch):
    import transformers

    fields = set(getattr(transformers, HF_CONFIG_CLASSES[arch])().to_dict())
    unclassified = sorted(f for f in fields if field_group(arch, f) is None)
    assert not unclassified, f"{arch}: fields with no honoured/ignored/refused entry: {unclassified}"
    assert all(field_group(arch, f)[0] in (HONOURED, IGNORED, REFUSED) for f in fields)


@pytest.mark.parametrize("arch", list(HF_CONFIG_CLASSES))
def test_a_config_saved_by_transformers_loads(arch, tmp_path):
    cfg = read(tmp_path, saved_config(arch, tmp_path))
    assert cfg.architecture == arch and cfg.rope.rope_type == "default" and cfg.rope.theta == 10000.0
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2
    assert cfg.qkv_bias == (arch == "Qwen2ForCausalLM") and not cfg.o_proj_bias and not cfg.mlp_bias


def _set(**fields):
    return lambda cfg: cfg.update(fields)


def _rope(**fields):
    return lambda cfg: cfg["rope_parameters"].update(fields)


def _drop_head_dim(hidden: int):
    def edit(cfg):
        cfg.pop("head_dim", None)
        cfg["hidden_size"] = hidden
    return edit


def _qwen2_window(first_sliding_layer: int | None = None, layer_types=None, use=True):
    def edit(cfg):
        cfg.update(use_sliding_window=use, sliding_window=16)
        if layer_types is None:
            cfg.pop("layer_types", None)  # derived from max_window_layers, as transformers<5 configs are
            cfg["max_window_layers"] = first_sliding_layer
        else:
            cfg["layer_types"] = layer_types
    return edit


REFUSALS = [
    # (architecture, edit of a saved config.json, field the message must name)
    ("LlamaForCausalLM", _rope(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                               original_max_position_embeddings=64), "rope_type 'longrope'"),
    ("LlamaForCausalLM", _rope(rope_type="su"), "rope_type 'su'"),
    ("LlamaForCausalLM", _rope(rope_type="llama3", factor=8.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64), "low_freq_factor"),
    ("LlamaForCausalLM", _rope(rope_type="linear"), "factor"),
    ("LlamaForCausalLM", _rope(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("LlamaForCausalLM", _set(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("LlamaForCausalLM", _rope(mrope_section=[2, 3, 3]), "mrope_section"),
    ("LlamaForCausalLM", _set(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters"),
    ("LlamaForCausalLM", _set(rope_theta=500000.0), "rope_theta"),
    ("LlamaForCausalLM", _set(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.type"),
    ("LlamaForCausalLM", _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, truncate="no"),
     "truncate"),
    ("LlamaForCausalLM", lambda c: (c["rope_parameters"].update(rope_type="yarn", factor=4.0,
                                                                original_max_position_embeddings=64),
                                    c.update(original_max_position_embeddings=128)),
     "original_max_position_embeddings"),
    ("LlamaForCausalLM", _set(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("LlamaForCausalLM", _set(final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("LlamaForCausalLM", _set(hidden_act="gelu"), "hidden_act"),
    ("LlamaForCausalLM", _set(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    ("LlamaForCausalLM", _set(quantization_config={"quant_method": "awq", "bits": 4}), "quantization_config"),
    ("LlamaForCausalLM", _set(is_encoder_decoder=True), "is_encoder_decoder"),
    ("LlamaForCausalLM", _set(add_cross_attention=True), "add_cross_attention"),
    ("LlamaForCausalLM", _set(pruned_heads={"0": [1]}), "pruned_heads"),
    ("LlamaForCausalLM", _set(use_qk_norm=True), "use_qk_norm"),
    ("LlamaForCausalLM", _set(num_local_experts=8), "num_local_experts"),
    ("LlamaForCausalLM", _set(attention_multiplier=1.0), "attention_multiplier"),
    ("LlamaForCausalLM", _set(query_pre_attn_scalar=256), "query_pre_attn_scalar"),
    ("LlamaForCausalLM", _set(no_rope_layers=[1, 0]), "no_rope_layers"),
    ("LlamaForCausalLM", _set(model_type="qwen3"), "model_type"),
    ("LlamaForCausalLM", _set(architectures=["GemmaForCausalLM"]), "architecture"),
    ("LlamaForCausalLM", _set(head_dim=15), "head_dim"),
    ("LlamaForCausalLM", _set(num_key_value_heads=3), "num_key_value_heads"),
    ("LlamaForCausalLM", _drop_head_dim(66), "hidden_size"),
    ("LlamaForCausalLM", _set(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    ("MistralForCausalLM", _set(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("MistralForCausalLM", _set(sliding_window=0), "sliding_window"),
    ("Qwen2ForCausalLM", _qwen2_window(first_sliding_layer=1), "layer_types"),
    ("Qwen2ForCausalLM", _qwen2_window(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    ("Qwen2ForCausalLM", _qwen2_window(layer_types=["sliding_attention"] * 2, use=False), "use_sliding_window"),
]


@pytest.mark.parametrize("arch,edit,named", REFUSALS,
                         ids=[f"{a[:5]}-{n.split()[0]}-{i}" for i, (a, _, n) in enumerate(REFUSALS)])
def test_unimplemented_fields_refuse_the_load_naming_the_field(tmp_path, arch, edit, named):
    cfg = saved_config(arch, tmp_path)
    edit(cfg)
    with pytest.raises(ValueError) as err:
        read(tmp_path, cfg)
    message = str(err.value)
    assert message.startswith("model: ") and named in message, message


def test_neutral_values_of_refused_fields_load(tmp_path):
    cfg = saved_config("LlamaForCausalLM", tmp_path)
    cfg.update(partial_rotary_factor=1.0, attn_logit_softcapping=None, quantization_config=None,
               num_local_experts=0, use_qk_norm=False, embedding_multiplier=1.0, is_encoder_decoder=False,
               layer_types=["full_attention"] * 2, rope_scaling=None)
    assert read(tmp_path, cfg).rope.rope_type == "default"


def test_ignored_fields_load_and_unknown_ones_are_named_in_a_warning(tmp_path, caplog):
    cfg = saved_config("LlamaForCausalLM", tmp_path)
    cfg.update(pretraining_tp=4, sliding_window=8, attention_dropout=0.1, some_future_field=3)
    cfg["rope_parameters"].update(rope_type="dynamic", factor=2.0, original_max_position_embeddings=32)
    with caplog.at_level(logging.WARNING, logger="pagedserve.model"):
        model = read(tmp_path, cfg)
    assert model.sliding_window is None  # LlamaAttention has no window: HF ignores it too
    # HF's dynamic NTK scales from max_position_embeddings, not original_max_position_embeddings
    assert model.rope.original_max_position_embeddings == cfg["max_position_embeddings"]
    assert "some_future_field" in caplog.text and "original_max_position_embeddings" in caplog.text


def test_qwen2_window_follows_layer_types(tmp_path):
    base = saved_config("Qwen2ForCausalLM", tmp_path)
    for edit, window in [(_qwen2_window(first_sliding_layer=2), None),   # transformers' default: no layer slides
                         (_qwen2_window(first_sliding_layer=0), 16),
                         (_qwen2_window(layer_types=["sliding_attention"] * 2), 16),
                         (_qwen2_window(layer_types=["full_attention"] * 2), None)]:
        cfg = json.loads(json.dumps(base))
        edit(cfg)
        assert read(tmp_path, cfg).sliding_window == window


# -- honoured fields run like HF ----------------------------------------------------------

def _randomize_biases(path, seed: int = 0) -> None:
    """HF initialises biases to zero; make them matter."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=gen) * 0.08
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _parity(path, prompts, max_tokens, **engine_args):
    llm = LLM(str(path), preemption_mode="recompute", num_kv_blocks=64, **engine_args)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, max_tokens)


def _prompts(seed: int, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in lengths]


def test_llama_attention_and_mlp_biases_match_hf(tmp_path):
    path = make_checkpoint(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    _randomize_biases(path)
    cfg = read_model_config(path)
    assert cfg.qkv_bias and cfg.o_proj_bias and cfg.mlp_bias
    _parity(path, _prompts(0, [7, 40]), [12, 8])


@pytest.mark.parametrize("first_sliding_layer", [0, 2], ids=["all-layers-slide", "no-layer-slides"])
def test_qwen2_sliding_window_matches_hf(tmp_path, first_sliding_layer):
    """use_sliding_window with max_window_layers = num_layers (transformers' own default shape)
    slides no layer at all; max_window_layers = 0 slides every layer."""
    path = make_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8,
                           max_window_layers=first_sliding_layer)
    assert read_model_config(path).sliding_window == (8 if first_sliding_layer == 0 else None)
    _parity(path, _prompts(1, [30, 12]), [10, 14])
