// A Llama-family decoder's whole forward on CPU tensors in one foreign call: every layer's norms,
// GEMMs, rotary embedding, K/V write and paged attention, then the final norm.
//
// No kernel lives here. The per-op path (model/llama.py) makes ~10 Python -> ctypes calls per
// layer into fused.cpp, gemm.cpp and paged_attention.cpp, each costing a few microseconds of
// Python, argument conversion and tensor checks; on a small model at decode sizes that is most
// of the forward. This file makes the very same calls, to the very same compiled functions
// (their addresses, taken from the libraries the per-op path loaded: PsDecoderKernels), with
// the same arguments in the same order, so its results equal the per-op path's bit for bit.
// pagedserve/model/cpu/decoder.py builds the structures below once per model (and once per
// step for PsDecoderStep) and decides when this path applies.
//
// Plain C++17 with a C ABI, built at first use by pagedserve/native.py like the kernels.
#include <cstdint>

namespace {

constexpr int kAbiVersion = 1;

// The kernels' C signatures (fused.cpp, gemm.cpp, paged_attention.cpp; the plans are
// PsAttentionPlan*, passed through unread).
using RmsNormFn = int (*)(int, const void*, int64_t, const void*, void*, int64_t, int64_t, int64_t, float, int, int);
using AddRmsNormFn = int (*)(int, const void*, int64_t, void*, int64_t, const void*, void*, int64_t, int64_t, int64_t,
                             float, int, int);
using SiluAndMulFn = int (*)(int, const void*, int64_t, void*, int64_t, int64_t, int64_t, int);
using RotaryFn = int (*)(int, void*, int64_t, int64_t, int64_t, void*, int64_t, int64_t, int64_t, const void*, int64_t,
                         const void*, int64_t, int64_t, int64_t, int);
using GemmFn = void (*)(const void*, int64_t, int64_t, int64_t, const void*, int64_t, const void*, void*, int64_t, int);
using AttentionLayerFn = int (*)(const void*, const int64_t*, int64_t, const void*, int64_t, const void*, int64_t,
                                 const void*, int64_t, void*, int64_t, void*, void*, int64_t, int64_t, int64_t, int,
                                 int64_t, int64_t, int64_t, float, int);
using FreshPrefillFn = int (*)(int64_t, const int32_t*, const int32_t*, const void*, int64_t, const void*, int64_t,
                               const void*, int64_t, void*, int64_t, int, int64_t, int64_t, int64_t, float, int);
using CachedPrefillFn = int (*)(const void*, const void*, int64_t, const void*, const void*, int64_t, int64_t, int64_t,
                                void*, int64_t, int, int64_t, int64_t, int64_t, float, int);

}  // namespace

extern "C" {

struct PsDecoderKernels {
    RmsNormFn rms_norm;
    AddRmsNormFn add_rms_norm;
    SiluAndMulFn silu_and_mul;
    RotaryFn rotary;
    GemmFn gemm;  // ps_gemm or ps_gemm_bf16: the model's dtype
    AttentionLayerFn attention_layer;
    FreshPrefillFn fresh_prefill;
    CachedPrefillFn cached_prefill;
};

// One decoder layer's weights (GEMM weights packed by gemm.cpp; a bias may be null) and its
// K/V pool ([num_slots, kv_heads, head_dim] each, contiguous).
struct PsDecoderLayer {
    const void* input_norm;
    const void* qkv;
    const void* qkv_bias;
    const void* o;
    const void* o_bias;
    const void* post_norm;
    const void* gate_up;
    const void* gate_up_bias;
    const void* down;
    const void* down_bias;
    void* k_cache;
    void* v_cache;
};

// What stays put for a model: its shapes, codes, constants and layers.
struct PsDecoderModel {
    PsDecoderKernels kernels;
    const PsDecoderLayer* layers;
    int64_t num_layers;
    int64_t hidden;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t intermediate;
    int64_t block_stride;  // block_size * token_stride, in elements
    int64_t token_stride;  // elements between two slots of one layer's pool
    const void* final_norm;
    float eps;        // every layer norm's
    float final_eps;  // the final norm's
    float scale;      // attention's softmax scale
    int fused_dtype;  // fused.cpp's dtype code
    int attn_dtype;   // paged_attention.cpp's dtype code
};

// What one step passes: its rows, their buffers, RoPE rows and attention metadata.
struct PsDecoderStep {
    int64_t rows;
    void* hidden;  // [rows, hidden]: the embeddings in; becomes the residual stream (updated in place)
    void* out;     // [rows, hidden]: the final norm's output
    // scratch, each contiguous: [rows, hidden], [rows, q + 2 kv], [rows, q], [rows, hidden],
    // [rows, 2 * intermediate], [rows, intermediate], [rows, hidden]
    void* normed;
    void* qkv;
    void* attn;
    void* o;
    void* gate_up;
    void* act;
    void* mlp;
    const void* cos;
    const void* sin;
    int64_t cos_stride;
    const void* plan;
    const int64_t* slot_mapping;
    int64_t num_fresh;  // fresh causal chunks for the tiled path (0: none)
    const int32_t* fresh_start;
    const int32_t* fresh_len;
    const void* cached_plan;  // chunks after cached keys for the tiled path (null: none)
    int lanes;                // torch's sum width (fused.py torch_sum_lanes)
    int threads;
};

int ps_abi_version() { return kAbiVersion; }

// Returns 0; or, at the first kernel that fails, (layer index + 1) * 16 + which: 1 a norm,
// 2 rotary, 3 attention (ps_attention_layer), 4 the fresh tiled path, 5 the cached tiled path,
// 6 SiLU * up, 7 the final norm (layer index = num_layers) — with the kernel's own return code
// in *kernel_rc. Nothing after the failing kernel runs.
int ps_decoder_forward(const PsDecoderModel* m, const PsDecoderStep* s, int* kernel_rc) {
    const PsDecoderKernels& k = m->kernels;
    const int64_t rows = s->rows, hidden = m->hidden, head_dim = m->head_dim;
    const int64_t heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_width = q_size + 2 * kv_size;
    const int64_t inter = m->intermediate;
    const int64_t elem = m->fused_dtype == 0 ? 4 : 2;
    char* qkv = static_cast<char*>(s->qkv);
    void* k_rows = qkv + q_size * elem;
    void* v_rows = qkv + (q_size + kv_size) * elem;
    const int lanes = s->lanes, threads = s->threads;
    int rc = 0;
#define PS_CHECK(call, which, layer)                  \
    do {                                              \
        if ((rc = (call)) != 0) {                     \
            *kernel_rc = rc;                          \
            return (int64_t(layer) + 1) * 16 + which; \
        }                                             \
    } while (0)
    for (int64_t l = 0; l < m->num_layers; ++l) {
        const PsDecoderLayer& w = m->layers[l];
        // x = norm(h) for the first layer (the embeddings are the residual), else
        // residual += h (the last MLP output); x = norm(residual)
        if (l == 0) {
            PS_CHECK(k.rms_norm(m->fused_dtype, s->hidden, hidden, w.input_norm, s->normed, hidden, rows, hidden,
                                m->eps, lanes, threads), 1, l);
        } else {
            PS_CHECK(k.add_rms_norm(m->fused_dtype, s->mlp, hidden, s->hidden, hidden, w.input_norm, s->normed, hidden,
                                    rows, hidden, m->eps, lanes, threads), 1, l);
        }
        if (rows) k.gemm(s->normed, hidden, rows, hidden, w.qkv, qkv_width, w.qkv_bias, s->qkv, qkv_width, threads);
        PS_CHECK(k.rotary(m->fused_dtype, s->qkv, qkv_width, head_dim, heads, k_rows, qkv_width, head_dim, kv_heads,
                          s->cos, s->cos_stride, s->sin, s->cos_stride, rows, head_dim, threads), 2, l);
        PS_CHECK(k.attention_layer(s->plan, s->slot_mapping, rows, k_rows, qkv_width, v_rows, qkv_width, s->qkv,
                                   qkv_width, s->attn, q_size, w.k_cache, w.v_cache, m->block_stride, head_dim,
                                   m->token_stride, m->attn_dtype, heads, kv_heads, head_dim, m->scale, threads), 3, l);
        if (s->num_fresh) {
            PS_CHECK(k.fresh_prefill(s->num_fresh, s->fresh_start, s->fresh_len, s->qkv, qkv_width, k_rows, qkv_width,
                                     v_rows, qkv_width, s->attn, q_size, m->attn_dtype, heads, kv_heads, head_dim,
                                     m->scale, threads), 4, l);
        }
        if (s->cached_plan) {  // the chunks' K/V were written to the pool by attention_layer above
            PS_CHECK(k.cached_prefill(s->cached_plan, s->qkv, qkv_width, w.k_cache, w.v_cache, m->block_stride,
                                      head_dim, m->token_stride, s->attn, q_size, m->attn_dtype, heads, kv_heads,
                                      head_dim, m->scale, threads), 5, l);
        }
        if (rows) k.gemm(s->attn, q_size, rows, q_size, w.o, hidden, w.o_bias, s->o, hidden, threads);
        PS_CHECK(k.add_rms_norm(m->fused_dtype, s->o, hidden, s->hidden, hidden, w.post_norm, s->normed, hidden, rows,
                                hidden, m->eps, lanes, threads), 1, l);
        if (rows) {
            k.gemm(s->normed, hidden, rows, hidden, w.gate_up, 2 * inter, w.gate_up_bias, s->gate_up, 2 * inter,
                   threads);
        }
        PS_CHECK(k.silu_and_mul(m->fused_dtype, s->gate_up, 2 * inter, s->act, inter, rows, inter, threads), 6, l);
        if (rows) k.gemm(s->act, inter, rows, inter, w.down, hidden, w.down_bias, s->mlp, hidden, threads);
    }
    PS_CHECK(k.add_rms_norm(m->fused_dtype, s->mlp, hidden, s->hidden, hidden, m->final_norm, s->out, hidden, rows,
                            hidden, m->final_eps, lanes, threads), 7, m->num_layers);
#undef PS_CHECK
    return 0;
}

}  // extern "C"
