#!/usr/bin/env python
"""Train pagedserve's built-in default model: a toy Llama that writes Python-looking code.

Everything it needs is already on the machine: the corpus is the running interpreter's own
standard-library sources, the tokenizer is trained here with HF `tokenizers`, and the model is a
`transformers` LlamaForCausalLM trained on the CPU. No download happens.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python scripts/train_default_model.py \
        --out pagedserve/default_model --seed 0 --steps 1000 --threads 1

Output: a normal HF checkpoint directory (config.json, model.safetensors in bfloat16, tokenizer
files with a chat template, generation_config.json) plus training_summary.json, which records the
held-out loss and perplexity measured in fp32 before the bf16 cast and again after reloading the
bf16 files.

Reproducibility: with the same seed, step budget, corpus cap and interpreter the run is
deterministic (fixed file order, seeded window sampling, single-threaded torch with
deterministic algorithms). `--minutes` is a convenience that turns a time budget into a step
count from a short calibration, so it is *not* reproducible; the summary records the step count
to pass as `--steps` instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# Thread counts must be fixed before torch / tokenizers create their pools.
def _preparse_threads(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return 1


_THREADS = _preparse_threads(sys.argv[1:])
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_var] = str(_THREADS)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sysconfig  # noqa: E402

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SERVED_MODEL_NAME = "pagedserve-toy-llama-4m-pystdlib"

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

# Directories of the standard library that are not representative code: test suites, IDLE,
# the retired 2to3 tool, installed third-party packages, and generated data tables.
SKIP_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
    "encodings", "pydoc_data", "__pycache__",
}

# A code model has no real notion of a conversation; the template says so plainly by writing
# the turns as Python comments and letting the model continue after "# assistant:".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "# {{ message['role'] }}: {{ message['content'] | replace('\n', '\n# ') }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}"
)

HELD_OUT_EVERY = 20  # every 20th file (in sorted order) is held out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="pagedserve/default_model", help="output checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps (reproducible budget)")
    budget.add_argument("--minutes", type=float, default=None,
                        help="wall-clock training budget; converted to steps after a short calibration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-corpus-mb", type=float, default=64.0,
                        help="cap on the training-split source text read (MB)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=688)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-windows", type=int, default=64,
                        help="number of fixed held-out windows of --seq-len tokens")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--no-bf16-autocast", dest="bf16_autocast", action="store_false",
                        help="train matmuls in fp32 (about half the speed on CPUs with bf16 support)")
    args = parser.parse_args()
    if args.steps is None and args.minutes is None:
        args.steps = 1000  # the shipped model's budget
    return args


# ---------------------------------------------------------------------------------------- corpus

def stdlib_source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIP_DIRS for part in parts[:-1]):
            continue
        files.append(path)
    return files


def split_corpus(files: list[Path], max_train_bytes: int) -> tuple[list[str], list[str], dict]:
    train_texts, held_out_texts = [], []
    train_bytes = 0
    for index, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            held_out_texts.append(text)
        elif train_bytes < max_train_bytes:
            train_texts.append(text)
            train_bytes += len(text.encode("utf-8"))
    info = {
        "stdlib_dir": sysconfig.get_paths()["stdlib"],
        "python_version": sys.version.split()[0],
        "num_files_total": len(files),
        "num_train_files": len(train_texts),
        "num_held_out_files": len(held_out_texts),
        "train_bytes": train_bytes,
        "held_out_bytes": sum(len(t.encode("utf-8")) for t in held_out_texts),
        "held_out_rule": f"every {HELD_OUT_EVERY}th file in sorted path order",
        "skipped_dirs": sorted(SKIP_DIRS),
    }
    return train_texts, held_out_texts, info


# ------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level: every byte is in the base alphabet, so no input is ever unknown.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)],
    )
    for token, expected_id in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))):
        assert tokenizer.token_to_id(token) == expected_id, token
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One long stream: <s> doc </s> <s> doc </s> ..."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def hf_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------------------- model

def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    return model.float()


def lr_at(step: int, total_steps: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def held_out_windows(stream: torch.Tensor, seq_len: int, num_windows: int) -> torch.Tensor:
    """Fixed, evenly spaced, non-overlapping windows of seq_len + 1 tokens."""
    available = (len(stream) - 1) // (seq_len + 1)
    count = min(num_windows, available)
    stride = available // count
    starts = [i * stride * (seq_len + 1) for i in range(count)]
    return torch.stack([stream[s : s + seq_len + 1] for s in starts])


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int = 16) -> float:
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_loss += loss.item()
        total_tokens += batch[:, 1:].numel()
    model.train()
    return total_loss / total_tokens


def sample_batch(stream: torch.Tensor, args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=generator)
    return torch.stack([stream[s : s + args.seq_len + 1] for s in starts.tolist()])


def train_step(model, optimizer, batch, lr: float, bf16_autocast: bool) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    # Master weights and optimizer state stay fp32; only the matmuls run in bf16.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def make_optimizer(model: LlamaForCausalLM, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.dim() >= 2 and "embed" not in name else no_decay).append(param)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )


# ------------------------------------------------------------------------------------------ main

def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    files = stdlib_source_files()
    train_texts, held_out_texts, corpus_info = split_corpus(files, int(args.max_corpus_mb * 1e6))
    print(f"corpus: {corpus_info['num_train_files']} train files ({corpus_info['train_bytes']/1e6:.2f} MB), "
          f"{corpus_info['num_held_out_files']} held-out files", flush=True)

    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream = encode_documents(tokenizer, train_texts)
    held_out_stream = encode_documents(tokenizer, held_out_texts)
    eval_windows = held_out_windows(held_out_stream, args.seq_len, args.eval_windows)
    t_data = time.perf_counter() - t_start
    print(f"tokenizer + encoding: {t_data:.1f}s; train tokens {len(train_stream):,}, "
          f"held-out tokens {len(held_out_stream):,} (eval on {eval_windows.shape[0]} windows of "
          f"{args.seq_len})", flush=True)

    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters", flush=True)
    optimizer = make_optimizer(model, args)
    data_generator = torch.Generator().manual_seed(args.seed)

    total_steps = args.steps
    calibration_steps = 0
    if total_steps is None:
        # Time a few steps at the warmup LR to turn the time budget into a step count.
        calibration_steps = 5
        t0 = time.perf_counter()
        for step in range(calibration_steps):
            train_step(model, optimizer, sample_batch(train_stream, args, data_generator),
                       lr_at(step, args.warmup_steps * 100, args), args.bf16_autocast)
        per_step = (time.perf_counter() - t0) / calibration_steps
        total_steps = calibration_steps + max(1, int(args.minutes * 60 / per_step))
        print(f"calibration: {per_step:.3f}s/step -> {total_steps} steps", flush=True)

    t_train = time.perf_counter()
    recent_losses: list[float] = []
    for step in range(calibration_steps, total_steps):
        batch = sample_batch(train_stream, args, data_generator)
        loss = train_step(model, optimizer, batch, lr_at(step, total_steps, args), args.bf16_autocast)
        recent_losses.append(loss)
        if (step + 1) % args.log_every == 0 or step + 1 == total_steps:
            elapsed = time.perf_counter() - t_train
            tokens = (step + 1 - calibration_steps) * args.batch_size * args.seq_len
            mean_loss = sum(recent_losses) / len(recent_losses)
            print(f"step {step + 1}/{total_steps} loss {mean_loss:.4f} "
                  f"lr {lr_at(step, total_steps, args):.2e} {tokens / elapsed:,.0f} tok/s "
                  f"{elapsed / 60:.1f} min", flush=True)
            last_train_loss = mean_loss
            recent_losses = []
    train_seconds = time.perf_counter() - t_train

    held_out_loss_fp32 = evaluate(model, eval_windows)
    print(f"held-out loss (fp32) {held_out_loss_fp32:.4f} ppl {math.exp(held_out_loss_fp32):.2f}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "pytorch_model.bin", "chat_template.jinja"):
        (out / stale).unlink(missing_ok=True)

    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.config.name_or_path = SERVED_MODEL_NAME
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    hf_tokenizer(tokenizer).save_pretrained(out)
    _patch_saved_files(out)

    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    held_out_loss_bf16 = evaluate(reloaded, eval_windows)
    print(f"held-out loss (bf16 weights, fp32 compute) {held_out_loss_bf16:.4f} "
          f"ppl {math.exp(held_out_loss_bf16):.2f}", flush=True)

    summary = {
        "served_model_name": SERVED_MODEL_NAME,
        "description": "Toy Llama-architecture code model trained on the Python standard library's "
                       "own sources; for trying the engine, not a useful assistant.",
        "command": " ".join(["python", "scripts/train_default_model.py"] + sys.argv[1:]),
        "seed": args.seed,
        "threads": args.threads,
        "steps": total_steps,
        "reproduce_with_steps": total_steps,
        "batch_size": args.batch_size,
        "bf16_autocast": args.bf16_autocast,
        "seq_len": args.seq_len,
        "tokens_seen": total_steps * args.batch_size * args.seq_len,
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95],
                      "weight_decay": args.weight_decay, "warmup_steps": args.warmup_steps,
                      "schedule": f"cosine to {args.min_lr_ratio} x lr", "grad_clip": 1.0},
        "num_parameters": num_params,
        "model_shape": {
            "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
            "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
            "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size,
            "tie_word_embeddings": True,
        },
        "corpus": corpus_info,
        "train_tokens_in_corpus": len(train_stream),
        "held_out_tokens_in_corpus": len(held_out_stream),
        "held_out_eval_tokens": int(eval_windows[:, 1:].numel()),
        "final_train_loss": last_train_loss,
        "held_out_loss_fp32": held_out_loss_fp32,
        "held_out_perplexity_fp32": math.exp(held_out_loss_fp32),
        "held_out_loss_bf16": held_out_loss_bf16,
        "held_out_perplexity_bf16": math.exp(held_out_loss_bf16),
        "data_prep_seconds": round(t_data, 1),
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "torch_version": torch.__version__,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {summary['wall_seconds'] / 60:.1f} min", flush=True)


def _patch_saved_files(out: Path) -> None:
    """Make the files self-describing for readers of either transformers major version."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["_name_or_path"] = SERVED_MODEL_NAME
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # transformers 5 writes the template to chat_template.jinja; older readers look for it in
    # tokenizer_config.json, so it lives in both.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
