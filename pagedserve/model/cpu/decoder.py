"""A Llama-family model's whole forward as one call into decoder.cpp, where every piece of it
already runs in pagedserve's C++ (the cpp GEMM for every linear layer, the fused elementwise
ops, the C++ paged attention kernel over a plain pool).

Why: at decode sizes on a small model the per-op path (model/llama.py) is ~10 Python -> ctypes
calls per layer, each a few microseconds of Python, argument conversion and tensor checks —
most of a 19M model's forward. decoder.cpp makes the same kernel calls, through the addresses
of the very functions the per-op path calls, with the same arguments in the same order: the
hidden states equal the per-op path's bit for bit (tests/test_native_forward.py).

When it serves (`NativeForward.build`, once per model at load; `forward`, per step):
- at load: CPU, fp32 or bf16, tensor parallel 1, the whole model in one stage, every layer
  exactly llama.DecoderLayer / Attention / MLP / RMSNorm, every Linear on the "cpp" method, the
  fused ops and the attention backend both chosen as "cpu", and each library a real loaded
  CDLL (a test's stand-in has no function addresses); PAGEDSERVE_NATIVE_FORWARD=off forces the
  per-op path. Otherwise the model keeps `native_forward = None` and one debug line says why.
- per step: the cpu backend's metadata with no chunk for SDPA (a window hiding keys), a plain
  pool of the model's dtype, RoPE rows the fused kernel takes, and tiled chunks only where the
  tiled kernels take the head grouping. Otherwise `forward` returns None and the per-op path
  runs that step.

Invariants kept from the per-op path: K/V written at the step's slots, the residual stream
updated in place in the embedding tensor, the returned hidden states a new tensor; the
intermediates live in buffers this object keeps for the last step size (<= scratch.MAX_ROWS
rows, as pagedserve/scratch.py keeps them), never handed out.
"""
from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from pagedserve import native, scratch
from pagedserve.attention import backend_for, cpu_backend
from pagedserve.attention.cpu import load_kernel
from pagedserve.model.cpu import fused, gemm

logger = logging.getLogger("pagedserve.model.decoder")

SOURCE = Path(__file__).with_name("decoder.cpp")
ABI_VERSION = 1
NATIVE_ENV = "PAGEDSERVE_NATIVE_FORWARD"
NATIVE_CHOICES = ("auto", "off")
FAILED_PART = {1: "a norm", 2: "rotary", 3: "attention", 4: "the fresh-prefill tiled path",
               5: "the cached-prefill tiled path", 6: "SiLU * up", 7: "the final norm"}

_ptr, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class DecoderKernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "gemm",
                                          "attention_layer", "fresh_prefill", "cached_prefill")]


class DecoderLayer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up",
                                          "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")]


class DecoderModel(ctypes.Structure):
    _fields_ = [("kernels", DecoderKernels), ("layers", ctypes.POINTER(DecoderLayer)), ("num_layers", _i64),
                ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("block_stride", _i64), ("token_stride", _i64), ("final_norm", _ptr),
                ("eps", _float), ("final_eps", _float), ("scale", _float), ("fused_dtype", _int),
                ("attn_dtype", _int)]


class DecoderStep(ctypes.Structure):
    _fields_ = [("rows", _i64), ("hidden", _ptr), ("out", _ptr), ("normed", _ptr), ("qkv", _ptr), ("attn", _ptr),
                ("o", _ptr), ("gate_up", _ptr), ("act", _ptr), ("mlp", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("cos_stride", _i64), ("plan", _ptr), ("slot_mapping", _ptr), ("num_fresh", _i64),
                ("fresh_start", _ptr), ("fresh_len", _ptr), ("cached_plan", _ptr), ("lanes", _int),
                ("threads", _int)]


def bind(lib: ctypes.CDLL) -> None:
    lib.ps_decoder_forward.argtypes = [ctypes.POINTER(DecoderModel), ctypes.POINTER(DecoderStep),
                                       ctypes.POINTER(ctypes.c_int)]
    lib.ps_decoder_forward.restype = _int


@cache
def load_library() -> ctypes.CDLL:
    """The compiled decoder loop (built now if no cached build fits); NativeUnavailable says why not."""
    return native.load_library(SOURCE, ABI_VERSION, bind, "CPU decoder loop")


def _address(lib, name: str) -> int:
    """The address of `lib`'s function `name`; TypeError for anything but a loaded CDLL."""
    if not isinstance(lib, ctypes.CDLL):
        raise TypeError(f"{type(lib).__name__} is not a loaded library")
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _plain_cpp_linear(linear) -> bool:
    from pagedserve.model.layers import Linear
    from pagedserve.model.parallel import RowParallelLinear
    return (type(linear) in (Linear, RowParallelLinear) and getattr(linear, "tp", 1) == 1
            and linear.method.name == "cpp" and "weight" in linear._buffers)


class NativeForward:
    """The model's forward in one decoder.cpp call; made by `build`, which returns None where
    it does not apply (see the module docstring)."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.num_steps = 0  # forwards served (tests assert the path ran, or did not)
        layers = list(model.layers)
        cfg = model.cfg
        first = layers[0]
        attn = first.self_attn
        self.fused_dtype = fused.DTYPE_CODES[dtype]
        self.attn_dtype = cpu_backend.TORCH_DTYPE_CODES[dtype]
        self.tiled = attn.num_heads // attn.num_kv_heads <= cpu_backend.FRESH_MAX_GROUP
        fused_lib, gemm_lib, attn_lib = fused.load_library(), gemm.load_gemm(), load_kernel()
        kernels = DecoderKernels(
            _address(fused_lib, "ps_rms_norm"), _address(fused_lib, "ps_add_rms_norm"),
            _address(fused_lib, "ps_silu_and_mul"), _address(fused_lib, "ps_rotary"),
            _address(gemm_lib, "ps_gemm" if dtype == torch.float32 else "ps_gemm_bf16"),
            _address(attn_lib, "ps_attention_layer"), _address(attn_lib, "ps_fresh_prefill"),
            _address(attn_lib, "ps_cached_prefill"))
        self.lib = load_library()
        self.layer_array = (DecoderLayer * len(layers))()
        # The structures hold raw addresses of these tensors: keep them alive with this object
        # (weights are not replaced after load; were one replaced, this would read the old one).
        self.weights = [t for t in (*model.parameters(), *model.buffers())]
        for entry, layer in zip(self.layer_array, layers):
            a, mlp = layer.self_attn, layer.mlp
            for field, linear in (("qkv", a.qkv_proj), ("o", a.o_proj), ("gate_up", mlp.gate_up_proj),
                                  ("down", mlp.down_proj)):
                bias = linear._parameters.get("bias")
                setattr(entry, field, linear._buffers["weight"].data_ptr())
                setattr(entry, field + "_bias", None if bias is None else bias.data_ptr())
            entry.input_norm = layer.input_layernorm._parameters["weight"].data_ptr()
            entry.post_norm = layer.post_attention_layernorm._parameters["weight"].data_ptr()
        norm = model.norm
        self.model_struct = DecoderModel(
            kernels, self.layer_array, len(layers), cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            first.mlp.inter, 0, 0, norm._parameters["weight"].data_ptr(), first.input_layernorm.eps, norm.eps,
            attn.scale, self.fused_dtype, self.attn_dtype)
        self.model_ref = ctypes.byref(self.model_struct)
        self.pool: torch.Tensor | None = None  # the pool whose layers' K/V the layer array points at
        self.step = DecoderStep()
        self.step_ref = ctypes.byref(self.step)
        self.kernel_rc = ctypes.c_int(0)
        self.rc_ref = ctypes.byref(self.kernel_rc)
        self.buffers: tuple[int, list[torch.Tensor]] | None = None
        q_size, kv_size = attn.q_size, attn.kv_size
        self.widths = (cfg.hidden_size, q_size + 2 * kv_size, q_size, cfg.hidden_size, 2 * first.mlp.inter,
                       first.mlp.inter, cfg.hidden_size)
        self.lanes = fused.torch_sum_lanes()

    @classmethod
    def build(cls, model) -> "NativeForward | None":
        """The native forward for `model`, or None (with one debug line saying why) where it
        does not apply; decided once, at load."""
        why = cls.refusal(model)
        if why is not None:
            logger.debug("the model's forward runs op by op: %s", why)
            return None
        try:
            load_library()
        except native.NativeUnavailable as e:
            logger.warning("CPU decoder loop unavailable, the model's forward runs op by op: %s", e)
            return None
        return cls(model, next(model.parameters()).dtype)

    @staticmethod
    def refusal(model) -> str | None:
        """Why the native forward cannot serve `model` (None: it can)."""
        from pagedserve.model.llama import MLP, Attention, DecoderLayer, RMSNorm
        if native.env_choice(NATIVE_ENV, NATIVE_CHOICES) == "off":
            return f"{NATIVE_ENV}=off"
        params = list(model.parameters())
        if not params or params[0].device.type != "cpu":
            return "not on CPU"
        dtype = params[0].dtype
        if dtype not in fused.DTYPE_CODES:
            return f"dtype {dtype}"
        shard = model.shard
        if shard.tp != 1:
            return "tensor parallel"
        modules = model._modules
        if modules.get("embed_tokens") is None or modules.get("norm") is None or type(modules["norm"]) is not RMSNorm:
            return "a pipeline stage without the embedding or the final norm"
        layers = list(modules["layers"])
        if not layers:
            return "no layers"
        if fused.fused_ops_for("cpu") != "cpu":
            return "the fused ops are torch's"
        if backend_for("cpu") != "cpu":
            return "the attention backend is not the C++ kernel"
        eps = layers[0].input_layernorm.eps
        for layer in layers:
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
                return f"layer type {type(layer).__name__} / {type(layer.self_attn).__name__} / " \
                       f"{type(layer.mlp).__name__}"
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(n) is not RMSNorm or n.eps != eps for n in norms):
                return "layer norms of another type or eps"
            a, mlp = layer.self_attn, layer.mlp
            for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not _plain_cpp_linear(linear):
                    return f"a linear layer on the {linear.method.name!r} method"
            if (a.num_heads, a.num_kv_heads, a.head_dim, mlp.inter) != (layers[0].self_attn.num_heads,
                                                                         layers[0].self_attn.num_kv_heads,
                                                                         layers[0].self_attn.head_dim,
                                                                         layers[0].mlp.inter):
                return "layers of different shapes"
        if any(p.dtype != dtype or p.device.type != "cpu" or not p.is_contiguous() for p in model.parameters()):
            return "parameters of mixed dtypes or layouts"
        try:
            for lib, name in ((fused.load_library(), "ps_rms_norm"), (gemm.load_gemm(), "ps_gemm"),
                              (load_kernel(), "ps_attention_layer")):
                _address(lib, name)
        except (TypeError, AttributeError, native.NativeUnavailable) as e:
            return f"a kernel library's functions cannot be called natively: {e}"
        return None

    # -- per step -----------------------------------------------------------------------------
    def _bind_pool(self, kv_cache: torch.Tensor) -> bool:
        """Point each layer's K/V at `kv_cache` (done once per pool tensor); False where the pool
        is not a contiguous plain tensor of the model's dtype."""
        if kv_cache is self.pool:
            return True
        if (type(kv_cache) is not torch.Tensor or kv_cache.dtype != self.dtype or not kv_cache.is_contiguous()
                or tuple(kv_cache.shape[:2]) != (len(self.layer_array), 2)
                or tuple(kv_cache.shape[3:]) != (self.model_struct.num_kv_heads, self.model_struct.head_dim)):
            return False
        views = self.model._layer_caches(kv_cache)
        for entry, (k_cache, v_cache) in zip(self.layer_array, views):
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self.model_struct.token_stride = views[0][0].stride(0)
        self.pool = kv_cache
        return True

    def _scratch(self, rows: int) -> list[torch.Tensor]:
        kept = self.buffers
        if kept is not None and kept[0] == rows:
            return kept[1]
        tensors = [torch.empty(rows, width, dtype=self.dtype) for width in self.widths]
        if rows <= scratch.MAX_ROWS and all(t.numel() * t.element_size() <= scratch.MAX_BYTES for t in tensors):
            self.buffers = (rows, tensors)
        return tensors

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta,
                prompt_lens: torch.Tensor | None) -> torch.Tensor | None:
        """The final hidden states [T, hidden], or None where this step needs the per-op path
        (nothing has been written then)."""
        if type(meta) is not cpu_backend.KernelMetadata or meta.sdpa_chunks:
            return None
        if (meta.fresh_chunks or meta.cached_spans) and not self.tiled:
            return None
        if not self._bind_pool(kv_cache):
            return None
        model = self.model
        cos, sin = model.rotary(positions, prompt_lens)
        cos_stride = cos.stride()
        rows = input_ids.shape[0]
        if (cos.dtype != self.dtype or sin.dtype != self.dtype or cos_stride[-1] != 1
                or not fused.rotary_table_fits(rows, self.model_struct.head_dim, cos, sin, cos_stride)):
            return None
        token_stride = self.model_struct.token_stride
        meta.check_bounds(kv_cache.shape[2])
        self.model_struct.block_stride = meta.block_size * token_stride
        hidden = model._modules["embed_tokens"].forward(input_ids)
        out = torch.empty(rows, self.widths[0], dtype=self.dtype)
        normed, qkv, attn, o, gate_up, act, mlp = self._scratch(rows)
        step = self.step
        step.rows = rows
        step.hidden, step.out = hidden.data_ptr(), out.data_ptr()
        step.normed, step.qkv, step.attn, step.o = normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(), o.data_ptr()
        step.gate_up, step.act, step.mlp = gate_up.data_ptr(), act.data_ptr(), mlp.data_ptr()
        step.cos, step.sin, step.cos_stride = cos.data_ptr(), sin.data_ptr(), cos_stride[0]
        step.plan = ctypes.addressof(meta.plan)
        step.slot_mapping = meta.slot_mapping.data_ptr()
        if meta.fresh_chunks:
            step.num_fresh = len(meta.fresh_chunks)
            step.fresh_start, step.fresh_len = meta.fresh_rows[0].ctypes.data, meta.fresh_rows[1].ctypes.data
        else:
            step.num_fresh, step.fresh_start, step.fresh_len = 0, None, None
        step.cached_plan = ctypes.addressof(meta.cached_plan) if meta.cached_spans else None
        step.lanes, step.threads = self.lanes, torch.get_num_threads()
        rc = self.lib.ps_decoder_forward(self.model_ref, self.step_ref, self.rc_ref)
        if rc:
            layer, part = divmod(rc, 16)
            raise RuntimeError(f"native decoder forward: {FAILED_PART.get(part, part)} failed in layer {layer - 1} "
                               f"(kernel returned {self.kernel_rc.value}; {rows} rows, {self.dtype}); "
                               f"{NATIVE_ENV}=off runs the model op by op")
        self.num_steps += 1
        return out

