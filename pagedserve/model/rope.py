"""Rotary position embedding for the RoPE types Llama, Qwen2 and Mistral checkpoints use.

Each type is computed with the same float32 expressions as HF transformers'
modeling_rope_utils, so cos/sin match HF's bit for bit on the same machine: default,
linear, llama3, yarn (its attention factor scales cos and sin, as HF does) and dynamic NTK.

Dynamic NTK, and why a token needs its request's prompt length. HF grows the RoPE base
whenever a forward pass sees a sequence longer than any before it (seq_len = max position
+ 1 > max_position_embeddings) and keeps the K it cached earlier. In `generate` for one
sequence the prompt is one forward pass and each new token another, so the token at
position p is rotated with the base for length s(p) = max(p + 1, prompt_len) (no scaling
while s(p) <= max_position_embeddings). That is what this module computes per token, given
each token's request prompt length. It depends only on the token's position and its
request's original prompt length, never on how the prompt was chunked or whether the
request was preempted and recomputed, so the paged engine reproduces HF's greedy output
whatever the scheduler did. (HF's rotary module also keeps its grown base across separate
`generate` calls until a short input resets it; that is state of HF's object, not of the
sequence, and is not reproduced.) A consequence: the K of a prompt longer than
max_position_embeddings depends on the prompt's length, so prefix-cache keys include it
(RopeConfig.prefix_cache_key).
"""
from __future__ import annotations

import math

import torch

from pagedserve.model.config import RopeConfig


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = default_inv_freq(rope.theta, dim)
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    base, factor, old_len = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # high-frequency dimensions keep their original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def static_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """inv_freq of every type whose frequencies do not depend on the sequence."""
    if rope.rope_type == "default":
        return default_inv_freq(rope.theta, dim)
    if rope.rope_type == "dynamic":
        # HF's value before any sequence outgrows the original length: its formula at
        # seq_len = original, in Python floats (the factor term is 1 up to rounding)
        factor = rope.factor
        length = rope.original_max_position_embeddings
        return default_inv_freq(rope.theta * ((factor * length / length) - (factor - 1)) ** (dim / (dim - 2)), dim)
    if rope.rope_type == "linear":
        return default_inv_freq(rope.theta, dim) / rope.factor
    if rope.rope_type == "llama3":
        return llama3_inv_freq(rope, dim)
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, dim)
    raise ValueError(f"model: rope_type {rope.rope_type!r} is not implemented")


class RotaryEmbedding:
    """cos/sin for a step's tokens, [T, 1, head_dim] in the model dtype.

    For the static types (all but dynamic NTK) with `max_positions` given (the engine's
    max_model_len, never max_position_embeddings: a 128k-context model served at 4k keeps a
    4k-row table), cos and sin of positions [0, max_positions) are computed once, by the same
    expressions as the per-step path below, and a step reads its rows with one index_select
    (0.09 ms of torch ops per 19M decode step before). Every op there is elementwise, so a
    row holds the same bits whichever tensor it was computed in (tests/test_rope.py checks
    each static type against the per-step path). A position past the table (the scheduler
    refuses prompts over max_model_len; a profiling forward of max_num_batched_tokens tokens
    may still go past it) is computed per step, never read out of bounds."""

    def __init__(self, rope: RopeConfig, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None) -> None:
        self.rope = rope
        self.dim = head_dim
        self.dtype = dtype
        self.inv_freq = static_inv_freq(rope, head_dim).to(device)
        self.exponents = (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim).to(device)
        # [max_positions, 2 (cos, sin), 1, head_dim]: one index_select gives a step both
        self.cos_sin_table: torch.Tensor | None = None
        if max_positions and rope.rope_type != "dynamic":
            cos, sin = self.compute(torch.arange(max_positions, device=device))
            self.cos_sin_table = torch.stack((cos, sin), dim=1)
        self.table_on_cpu = self.cos_sin_table is not None and self.cos_sin_table.device.type == "cpu"

    @property
    def needs_prompt_lens(self) -> bool:
        return self.rope.depends_on_prompt_len

    def __call__(self, positions: torch.Tensor, prompt_lens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64. prompt_lens: [T], each token's request prompt length
        (dynamic NTK only; None treats every token as the last of its prompt). From the table
        (cos and sin are then strided views of one tensor) where it covers the positions."""
        table = self.cos_sin_table
        if table is not None:
            if self.table_on_cpu:
                try:  # index_select checks every index before it reads
                    return torch.index_select(table, 0, positions).unbind(1)
                except IndexError:
                    pass  # a position past the table
            # elsewhere an out-of-range index is a device-side assert: check first (a sync)
            elif positions.numel() == 0 or int(positions.max()) < table.shape[0]:
                return torch.index_select(table, 0, positions).unbind(1)
        return self.compute(positions, prompt_lens)

    def compute(self, positions: torch.Tensor, prompt_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of `positions` computed now (the table's rows are made by this too)."""
        # (unsqueeze and broadcasting rather than [:, None] indexing, no .to when the dtype is
        # float32: the same values, fewer torch calls in every step)
        if self.rope.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions, prompt_lens)  # [T, dim/2]
            freqs = positions.unsqueeze(1).float() * inv_freq
        else:
            freqs = positions.unsqueeze(1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope.attention_factor != 1.0:
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        if self.dtype != torch.float32:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _dynamic_inv_freq(self, positions: torch.Tensor, prompt_lens: torch.Tensor | None) -> torch.Tensor:
        seq_len = positions + 1 if prompt_lens is None else torch.maximum(positions + 1, prompt_lens)
        original = self.rope.original_max_position_embeddings
        grown = seq_len > original
        if not bool(grown.any()):
            return self.inv_freq[None, :].expand(len(positions), -1)
        factor, dim = self.rope.factor, self.dim
        # HF's _compute_dynamic_ntk_parameters, in the same float32 order, one base per token
        base = self.rope.theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        scaled = 1.0 / (base[:, None] ** self.exponents[None, :])
        return torch.where(grown[:, None], scaled, self.inv_freq[None, :])
