"""The one resolve step: an EngineConfig and its checkpoint in, a ResolvedConfig out.

    the model's config   read once (config.json; no weights)
    the knobs            a read-only copy with the model-dependent defaults filled in
                         (max_model_len, max_num_batched_tokens, the CPU KV budget)
    the layout           refused here, with the numbers, before any rank starts
    dtype, KV dtype      the compute dtype for this device, and what the pool stores
    eos ids              generation_config.json, config.json and the tokenizer's, together

Everything built afterwards (the front-end's processors, the engine core, the executor, each
rank's ModelRunner) reads the ResolvedConfig and derives none of it again. The caller's
EngineConfig is never changed.
"""
from __future__ import annotations

import json
from pathlib import Path

from pagedserve.config import EngineConfig, ResolvedConfig, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.model.config import ModelConfig, check_data_parallel, check_model_parallel, read_model_config
from pagedserve.model.pipeline import check_pipeline_parallel
from pagedserve.tokenizer import load_tokenizer


def default_model_dir() -> str:
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR
    return str(DEFAULT_MODEL_DIR)


def with_model(config: EngineConfig) -> EngineConfig:
    """`config`, or a copy naming the built-in model when it names none."""
    if config.model is not None:
        return config
    import dataclasses
    return dataclasses.replace(config, model=default_model_dir())


def resolve_config(config: EngineConfig, tokenizer=None) -> tuple[ResolvedConfig, object]:
    """(the ResolvedConfig, the tokenizer): `tokenizer` if given, else the checkpoint's (None
    without one), loaded after the model and the layout passed their checks, since the eos
    ids count its eos token."""
    config = with_model(config)
    model_config = read_model_config(config.model)
    config = config.resolved_copy(model_config.max_model_len)
    check_layout(model_config, config)
    dtype = resolve_dtype(config.dtype, model_config.checkpoint_dtype, config.device)
    if tokenizer is None:
        tokenizer = load_tokenizer(config)
    return ResolvedConfig(config, model_config, dtype, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype),
                          eos_token_ids(config.model, model_config, tokenizer)), tokenizer


def check_layout(model_config: ModelConfig, config: EngineConfig) -> None:
    """The parallel layout's refusals, in one place: a TP size the heads, the MLP or the
    experts cannot be divided by, expert parallelism without experts, more pipeline stages
    than layers."""
    check_model_parallel(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
    check_pipeline_parallel(model_config.num_layers, config.pipeline_parallel_size)
    check_data_parallel(model_config, config.data_parallel_size, config.enable_expert_parallel)


def eos_token_ids(model_dir: str, model_config: ModelConfig, tokenizer=None) -> frozenset[int]:
    ids: set[int] = set()
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    eos = model_config.hf_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
