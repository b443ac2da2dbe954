"""Memory planning: where device memory goes and how many KV blocks fit.

The engine sizes its pool with the same functions (`kv_budget`), so a plan and a
start-up agree to the block:

    shape = ModelShape.from_hf_config(config_dict)
    pool = size_kv_pool(shape, kv_cache_memory, kv_dtype_bytes=dtype_bytes("bfloat16"),
                        block_size=16, tp=1)
    for line in kv_cache_log_lines(pool, max_model_len, device="CPU"):
        logger.info(line)
"""
from .kv_budget import (
    KVPoolSize,
    ModelShape,
    dtype_bytes,
    kv_bytes_per_token,
    kv_cache_log_lines,
    max_concurrency,
    num_blocks_for_bytes,
    size_kv_pool,
)

__all__ = [
    "KVPoolSize", "ModelShape", "dtype_bytes", "kv_bytes_per_token", "kv_cache_log_lines",
    "max_concurrency", "num_blocks_for_bytes", "size_kv_pool",
]
