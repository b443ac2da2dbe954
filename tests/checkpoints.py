"""Tiny random HF checkpoints and an offline-trained tokenizer, made on the fly (no hub)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.getcwd())\n",
    "Paged attention keeps the KV cache in fixed-size blocks handed out as tokens grow.",
    "class Scheduler:\n    def schedule(self):\n        return None\n",
]


def make_tokenizer(path: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    # The tiny corpus learns fewer tokens than the model's vocabulary: name the rest, so
    # every id the model can emit decodes to visible text (streams then carry every token).
    learned = tok.get_vocab_size()
    if learned < vocab_size:
        tok.add_tokens([f"<w{i}>" for i in range(learned, vocab_size)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(path)
    return fast


# Tiny MoE shapes (hidden 64, 4 heads by default): enough experts that top-k routing, groups
# and the shared experts all change the output.
MOE_DEFAULTS = {
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5),
}


def make_checkpoint(path: Path, arch: str = "llama", *, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, inter: int = 128, vocab: int = 384, max_pos: int = 1024, seed: int = 0,
                    init_std: float = 0.08, dtype: torch.dtype = torch.float32, **extra) -> Path:
    """Write a random checkpoint + tokenizer into `path`; returns path.

    init_std is larger than HF's 0.02 so logits are well separated: token-for-token parity
    then tests the engine, not floating-point ties between near-equal logits.
    """
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path, vocab)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  initializer_range=init_std, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    common.update(extra)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        common.setdefault("tie_word_embeddings", True)
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    elif arch == "mixtral":
        common.setdefault("num_local_experts", 4)
        cfg, cls = transformers.MixtralConfig(**common), transformers.MixtralForCausalLM
    elif arch == "qwen2_moe":
        common = {**MOE_DEFAULTS["qwen2_moe"], **common}
        cfg, cls = transformers.Qwen2MoeConfig(**common), transformers.Qwen2MoeForCausalLM
    elif arch == "deepseek_v3":
        common = {**MOE_DEFAULTS["deepseek_v3"], **common}
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: every head reads the latent
        cfg, cls = transformers.DeepseekV3Config(**common), transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # HF initialises biases (and DeepSeek's correction bias) to zero; make them matter
        for name, param in model.named_parameters():
            if arch in ("qwen2", "qwen2_moe") and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0, init_std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.2)  # reorders the choice, not the weights
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Reference: HF transformers generate, greedy, one prompt at a time, fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids, n in zip(prompts, max_tokens):
            inp = torch.tensor([ids])
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, min_new_tokens=n)
            outs.append(gen[0, len(ids):].tolist())
    return outs


class HFGreedyReference:
    """HF transformers (fp32) as the greedy reference, checked by teacher forcing: an output
    equals HF's greedy generation exactly when each of its tokens is the argmax of HF's logits
    after the prompt and the output's own earlier tokens (by induction over the tokens). One
    forward per sequence instead of one per generated token, so a 24-prompt reference costs
    a second rather than a minute."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def first_divergence(self, prompt: list[int], output: list[int]) -> int | None:
        """Index of the first output token that is not HF's greedy choice; None if all are."""
        if not output:
            return None
        ids = torch.tensor([list(prompt) + list(output[:-1])])
        with torch.no_grad():
            logits = self.model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
        greedy = logits.argmax(dim=-1).tolist()
        return next((j for j, (got, want) in enumerate(zip(output, greedy)) if got != want), None)

    def assert_greedy(self, prompts: list[list[int]], outputs: list[list[int]], max_tokens: list[int],
                      label: str = "") -> None:
        """Every output has its max_tokens tokens (ignore_eos) and each is HF's greedy choice."""
        assert len(outputs) == len(prompts), (len(outputs), len(prompts))
        for i, (prompt, tokens, n) in enumerate(zip(prompts, outputs, max_tokens)):
            assert len(tokens) == n, f"{label}prompt {i}: {len(tokens)} tokens, want {n}"
            j = self.first_divergence(prompt, tokens)
            assert j is None, f"{label}prompt {i} (len {len(prompt)}): token {j} is not HF's greedy choice"


def greedy_outputs(llm, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """`llm.generate` greedy (ignore_eos, so each output has its max_tokens), then checks that
    every block came back to the pool; returns each output's token ids."""
    from pagedserve import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks  # every block came back
    return [o.outputs[0].token_ids for o in outs]


def parity_workload(num_prompts: int, fixed_lengths=(1, 16, 17, 150), seed: int = 0):
    """Prompts for the parity tests (ids 2-383, fits make_tokenizer's vocabulary): first the
    `fixed_lengths` (one token, block-size edges, a long one), then random lengths of 2-150;
    every other prompt after the fixed ones starts with a shared 40-token prefix (prefix-cache
    hits; cut to 150 tokens). Returns (prompts, max_tokens), 1-24 output tokens each."""
    rng = random.Random(seed)
    first = len(fixed_lengths)
    lengths = list(fixed_lengths) + [rng.randint(2, 150) for _ in range(num_prompts - first)]
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in lengths]
    system = [rng.randrange(2, 384) for _ in range(40)]
    for i in range(first, num_prompts, 2):
        prompts[i] = (system + prompts[i])[:150]
    return prompts, [rng.randint(1, 24) for _ in lengths]


def saved_hf_config(arch: str, config_class: str, tmp_path: Path, fields: dict) -> dict:
    """config.json exactly as the installed transformers saves it: `config_class(**fields)` for `arch`."""
    import json

    import transformers

    cfg = getattr(transformers, config_class)(**fields)
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path / "saved")
    return json.loads((tmp_path / "saved" / "config.json").read_text())


def read_config_dict(tmp_path: Path, cfg: dict):
    """read_model_config on a directory holding `cfg` as its config.json."""
    import json

    from pagedserve.model.config import read_model_config

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_model_config(tmp_path)


def config_from_flags(argv: list[str]):
    """The EngineConfig the engine flags in `argv` make (engine_args.py), as a command line would."""
    import argparse

    from pagedserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))

