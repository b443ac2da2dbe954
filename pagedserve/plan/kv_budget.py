"""KV-cache arithmetic shared by `pagedserve plan` and the engine's pool sizing.

Torch-free on purpose: the planner, the simulator and the engine's start-up line
all call these functions, so they can never disagree about a block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
    "int4": 0.5,
}


# KV cache dtypes that store one byte per value and read it back through a scale.
QUANTIZED_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# Bytes a quantized KV cache keeps beside each (token, KV head) of K and of V: int8 stores one
# fp32 scale per token and head; fp8 uses one scale per layer for K and one for V (no per-token bytes).
KV_SCALE_BYTES = {"int8": 4}


def kv_scale_bytes(kv_dtype: str) -> int:
    """Scale bytes per token, KV head and K-or-V that a cache of `kv_dtype` stores (0 for most)."""
    return KV_SCALE_BYTES.get(kv_dtype, 0)


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder's config that decide its memory."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed
    # latent + the rope key per token per layer, shared by all heads.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    # The rest only matters for counting parameters and activations (plan/models.py).
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    attention_bias: bool = False
    # Mixture of experts: `num_experts` routed experts of width `moe_intermediate_size`,
    # `num_experts_per_tok` active per token, plus always-on shared experts of total
    # width `shared_expert_intermediate_size`; the first `first_dense_layers` layers
    # (DeepSeek's first_k_dense_replace) use a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    first_dense_layers: int = 0
    # per MoE layer, beside the router: Qwen2-MoE's [1, hidden] shared-expert gate, DeepSeek-V3's
    # [num_experts] e_score_correction_bias (both replicated on every rank)
    shared_expert_gate: bool = False
    router_bias: bool = False
    max_position_embeddings: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        """Read a HF `config.json` dict (Llama, Qwen2, Mistral, Mixtral, Qwen-MoE, DeepSeek-V2/V3).

        Multimodal configs that nest the decoder under `text_config` are unwrapped.
        A missing required key raises ValueError naming it.
        """
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a decoder config pagedserve can size")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        intermediate = int(cfg.get("intermediate_size") or 0)
        num_experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        moe_intermediate = int(cfg.get("moe_intermediate_size") or (intermediate if num_experts else 0))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if not shared and cfg.get("n_shared_experts"):
            shared = int(cfg["n_shared_experts"]) * moe_intermediate
        kv_lora_rank = cfg.get("kv_lora_rank")
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=intermediate,
            vocab_size=int(cfg.get("vocab_size") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            kv_lora_rank=int(kv_lora_rank) if kv_lora_rank else None,
            qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
            v_head_dim=cfg.get("v_head_dim"),
            # Qwen2 has biases on q/k/v without saying so in its config; Qwen2-MoE says so by qkv_bias.
            attention_bias=bool(cfg.get("qkv_bias", True) if cfg.get("model_type") == "qwen2_moe"
                                else cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=moe_intermediate,
            shared_expert_intermediate_size=shared,
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0) if num_experts else 0,
            shared_expert_gate=bool(num_experts and shared and cfg.get("model_type") == "qwen2_moe"),
            router_bias=bool(num_experts and (cfg.get("topk_method") == "noaux_tc"
                                              or cfg.get("model_type") == "deepseek_v3")),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        )


def kv_heads_per_rank(shape: ModelShape, tp: int = 1) -> int:
    """KV heads one TP rank stores: ceil(kv_heads / tp), never fewer than one.

    When TP exceeds the kv-head count, each head is replicated on tp / kv_heads ranks:
    the rank still needs a whole head for its share of query heads.
    """
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    return max(1, math.ceil(shape.num_kv_heads / tp))


def kv_replication(shape: ModelShape, tp: int = 1) -> float:
    """How many copies of each token's KV exist across the TP group (1.0 = no waste).

    MLA keeps the whole latent on every rank, so it is replicated `tp` times.
    """
    if shape.is_mla:
        return float(tp)
    return kv_heads_per_rank(shape, tp) * tp / shape.num_kv_heads


def kv_replication_warning(shape: ModelShape, tp: int) -> str | None:
    """The warning `pagedserve plan` prints and the engine logs when TP exceeds the KV heads."""
    if shape.is_mla or tp <= shape.num_kv_heads:
        return None
    copies = kv_replication(shape, tp)
    return (f"TP {tp} is larger than the model's {shape.num_kv_heads} KV heads: each KV head is replicated on "
            f"{copies:g} ranks, so the group spends {copies:g}x the KV memory per token.")


def kv_bytes_per_token(shape: ModelShape, kv_dtype_bytes: float, tp: int = 1, scale_bytes: int = 0) -> int:
    """KV bytes one token occupies on one GPU (one TP rank).

    MHA/GQA: ``2 (K and V) x layers x max(1, kv_heads / tp) x (head_dim x kv_dtype_bytes +
    scale_bytes)``; when TP exceeds the kv-head count each rank still holds a whole head
    (replication). `scale_bytes`: what a quantized cache keeps per token and head beside the
    values (`kv_scale_bytes`: 4 for int8). MLA: ``layers x ((kv_lora_rank + qk_rope_head_dim)
    x kv_dtype_bytes + scale_bytes)``: the latent is not split by TP at all; every rank holds
    the full cache.
    """
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if shape.is_mla:
        per_layer = (shape.kv_lora_rank + (shape.qk_rope_head_dim or 0)) * kv_dtype_bytes + scale_bytes
        return int(shape.num_layers * per_layer)
    per_head = shape.head_dim * kv_dtype_bytes + scale_bytes
    return int(2 * shape.num_layers * kv_heads_per_rank(shape, tp) * per_head)


def num_blocks_for_bytes(kv_pool_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """How many whole blocks fit in a pool of `kv_pool_bytes` (never rounds up)."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError(f"bytes_per_token and block_size must be > 0, got {bytes_per_token}, {block_size}")
    if kv_pool_bytes <= 0:
        return 0
    return int(kv_pool_bytes // (bytes_per_token * block_size))


def blocks_per_request(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """vLLM's worst-case number: requests of exactly `max_model_len` tokens that fit at once."""
    return num_blocks / blocks_per_request(max_model_len, block_size)


@dataclass(frozen=True)
class KVPoolSize:
    """The pool one rank allocates: whole blocks only, so `num_tokens <= bytes / bytes_per_token`."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def size_kv_pool(
    shape: ModelShape,
    kv_cache_memory: int,
    *,
    kv_dtype_bytes: float,
    block_size: int,
    tp: int = 1,
    scale_bytes: int = 0,
) -> KVPoolSize:
    """Size the KV pool for a byte budget: the one function plan and engine both call.

    `kv_cache_memory` is the pool budget per rank in bytes (on CPU, the user's
    `kv_cache_memory`; on GPU, what `plan.budget` leaves after weights and activations).
    `scale_bytes`: per token and KV head, as `kv_bytes_per_token` takes it.
    """
    bytes_per_token = kv_bytes_per_token(shape, kv_dtype_bytes, tp, scale_bytes)
    return KVPoolSize(
        num_blocks=num_blocks_for_bytes(kv_cache_memory, bytes_per_token, block_size),
        block_size=block_size,
        bytes_per_token=bytes_per_token,
    )


def size_kv_pool_for_dtype(shape: ModelShape, kv_cache_memory: int, kv_dtype: str, *, block_size: int,
                           tp: int = 1) -> KVPoolSize:
    """`size_kv_pool` for a resolved KV dtype name (float32, bfloat16, fp8_e4m3, int8 ...):
    its value bytes and its scale bytes, the way the engine stores it."""
    return size_kv_pool(shape, kv_cache_memory, kv_dtype_bytes=dtype_bytes(kv_dtype), block_size=block_size,
                        tp=tp, scale_bytes=kv_scale_bytes(kv_dtype))


def kv_cache_log_lines(pool: KVPoolSize, max_model_len: int, device: str = "GPU",
                       kv_dtype: str | None = None) -> list[str]:
    """The start-up lines, worded like vLLM's, that `pagedserve serve` and `plan` both print.

    The concurrency figure is the worst case: every request at exactly `max_model_len`.
    """
    return [
        f"{device} KV cache size: {pool.num_tokens:,} tokens ({pool.num_blocks:,} blocks of {pool.block_size})",
        f"Maximum concurrency for {max_model_len:,} tokens per request: "
        f"{max_concurrency(pool.num_blocks, pool.block_size, max_model_len):.2f}x (worst case)",
        f"{device} KV cache dtype: {kv_dtype or 'model dtype'}, {pool.bytes_per_token:,} bytes per token",
    ]


# Blocks the start-up bandwidth probe (auto preemption) writes into the host pool.
HOST_PROBE_BLOCKS = 64


def swap_space_line(num_host_blocks: int, bytes_per_block: int, device: str, tp: int = 1,
                    probed: bool = True) -> str:
    """What --swap-space really costs, for the start-up log and `plan`: on CUDA the host
    pool is pinned, so all of it is resident from start-up; on CPU it is mapped lazily and
    becomes resident as blocks are written, and the pool reuses recently freed blocks first,
    so it stays at the most blocks swapped out at once. The pool is laid out like the device
    pool ([layers, K/V, slots, ...]), so those blocks span one range in each layer's K and V,
    each rounded up to whole pages (numpy maps large arrays with transparent huge pages)."""
    per_rank = " per rank" if tp > 1 else ""
    total = num_host_blocks * bytes_per_block
    head = (f"swap space: {num_host_blocks:,} host blocks x {bytes_per_block / 2**10:,.0f} KiB = "
            f"{total / 2**30:.2f} GiB{per_rank}")
    if device.lower() == "cuda":
        return f"{head}, pinned: all of it resident from start-up"
    probe = (f", plus up to {min(HOST_PROBE_BLOCKS, num_host_blocks)} blocks the start-up copy probe of "
             f"auto preemption writes" if probed else "")
    return (f"{head} reserved (address space); resident: only the most blocks swapped out at once x "
            f"{bytes_per_block / 2**10:,.0f} KiB (freed host blocks are reused first), each layer's K and V "
            f"rounded up to the kernel's pages (2 MiB with transparent huge pages){probe}")
