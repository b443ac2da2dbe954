// Skinny GEMM for the model's fp32 linear layers on CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Plain C++17 with a C ABI (no torch headers), built at first use by pagedserve/native.py with
// -march=native and called through ctypes (pagedserve/model/cpu/gemm.py).
//
// Why: a decode step's GEMMs have M = the number of running requests (1-64), where BLAS
// libraries tuned for square problems reach a fraction of either the core's FMA rate or the
// memory bandwidth (benchmarks/README.md, "GEMM survey": 26 GFLOP/s at M=8 where streaming the
// weight once would allow ~70). Here the weight is packed once at load into panels of NR output
// columns, each panel [K][NR] contiguous, so one pass over a panel streams it linearly while MR
// rows of x are multiplied against it with MR x NR accumulators held in registers: each weight
// vector loaded feeds MR FMAs. Rows beyond MR re-read the panel from L2 (a panel is K x NR x 4
// bytes: 128 KB at K=1024). Threads split the panels, so each thread streams its own share of
// the weight once per call.
//
// Layout of a packed weight: panel p holds columns [p*NR, p*NR + NR) (N is a multiple of NR;
// gemm.py only offers this method for such shapes), element (k, c) at p*K*NR + k*NR + c.
//
// Numerics: each output is bias + sum over k in increasing order of x[m,k]*w[n,k] with one
// fused multiply-add per term, in fp32 (a single row: four such sums over k mod 4, added at the
// end) — a different rounding order from MKL's blocked sums, so results differ from F.linear by
// a few ulps, as oneDNN's do. The order depends only on M and K, never on the thread count.
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kAbiVersion = 2;

#if defined(__AVX512F__)
constexpr int VW = 16;
using vreg = __m512;
inline vreg vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vreg v) { _mm512_storeu_ps(p, v); }
inline void vstore_nt(float* p, vreg v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned
inline vreg vbroadcast(float a) { return _mm512_set1_ps(a); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm512_fmadd_ps(a, b, c); }
inline vreg vzero() { return _mm512_setzero_ps(); }
constexpr int NV = 2, MR = 8;  // 16 accumulators of the 32 vector registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
using vreg = __m256;
inline vreg vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vreg v) { _mm256_storeu_ps(p, v); }
inline void vstore_nt(float* p, vreg v) { _mm256_stream_ps(p, v); }  // p 32-byte aligned
inline vreg vbroadcast(float a) { return _mm256_set1_ps(a); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm256_fmadd_ps(a, b, c); }
inline vreg vzero() { return _mm256_setzero_ps(); }
constexpr int NV = 2, MR = 4;  // 8 accumulators + 2 weight vectors + 1 broadcast of 16 registers
#else
// Portable: plain loops the compiler vectorises for whatever the target has (NEON, SSE ...).
constexpr int VW = 4;
struct vreg {
    float v[VW];
};
inline vreg vload(const float* p) {
    vreg r;
    for (int i = 0; i < VW; ++i) r.v[i] = p[i];
    return r;
}
inline void vstore(float* p, vreg a) {
    for (int i = 0; i < VW; ++i) p[i] = a.v[i];
}
inline vreg vbroadcast(float a) {
    vreg r;
    for (int i = 0; i < VW; ++i) r.v[i] = a;
    return r;
}
inline vreg vfma(vreg a, vreg b, vreg c) {
    for (int i = 0; i < VW; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
inline vreg vzero() { return vbroadcast(0.0f); }
inline void vstore_nt(float* p, vreg a) { vstore(p, a); }
constexpr int NV = 2, MR = 4;
#endif

constexpr int NR = NV * VW;
// Software prefetch of a panel's first pass, k steps ahead, and the locality hint of every
// prefetch (__builtin_prefetch's third argument). AVX-512: 128 steps (16 KB) ahead into L2 —
// at 8-32 rows a k step is 16 FMAs (~16 cycles), so 4 KB ahead into L1 (the old setting) was
// ~140 ns of work, short of a DRAM miss here, and farther into L1 evicted the panel; one
// thread, 19M engine (gemm_lib_ab.py --cpu-time): 8 running 0.89x, 16 0.93x, 32 0.98x step
// time (benchmarks/README.md, "The 19M LM head"). AVX2 and the portable path, not measured
// with it: 32 steps ahead into L1 as before.
#if defined(__AVX512F__)
constexpr int kPrefetchRows = 128, kPrefetchLocality = 2;
#else
constexpr int kPrefetchRows = 32, kPrefetchLocality = 3;
#endif
// Up to this many rows of x (a decode of a few sequences: 1-4 with AVX-512, 1-2 with AVX2) a
// call is a pure weight stream: the hardware prefetchers keep a linear read of the panels ahead
// on their own, and a software prefetch per k step only takes load slots and miss buffers from
// it (cold weights, one thread, AVX-512: 11-35% more GB/s at M = 1 and -5..+10% at M = 2-4
// without it). With more FMAs per weight byte the prefetch pays again (M = 8 with AVX-512 and
// M = 4 with AVX2 were up to 15% and 30% slower without it): benchmarks/README.md, "GEMV on
// both cores".
constexpr int kStreamRows = MR / 2;
// Weights of at least this many elements are split across the threads even for one row of x:
// a one-row GEMM is a weight stream, which two cores read faster than one (each thread its own
// contiguous run of panels), and a 2-thread team costs ~1 us against ~10 us to read 64K floats.
constexpr int64_t kParallelWeight = int64_t(1) << 16;
// Outputs of at least this many bytes are written with non-temporal stores (ps_gemm).
constexpr int64_t kStreamOutBytes = int64_t(1) << 20;

// R rows of x (R <= MR) times one packed panel: out[r, 0:NR] = bias + x[r, :] . panel.
// Prefetch plan of one pass: at k step k, `lines` cache lines from base + k * step bytes.
struct Prefetch {
    const char* base;
    int64_t step;
    int lines;
};

// `nt`: the output goes out with non-temporal stores (ps_gemm decides; out then 64-byte aligned).
template <int R>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                         float* out, int64_t ldo, Prefetch pf, bool nt) {
    vreg acc[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[r][j] = bias ? vload(bias + j * VW) : vzero();
    for (int64_t k = 0; k < K; ++k) {
        const float* b = panel + k * NR;
        for (int line = 0; line < pf.lines; ++line) __builtin_prefetch(pf.base + k * pf.step + line * 64, 0, kPrefetchLocality);
        vreg w[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) w[j] = vload(b + j * VW);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const vreg a = vbroadcast(x[r * ldx + k]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) acc[r][j] = vfma(a, w[j], acc[r][j]);
        }
    }
    if (nt) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) vstore_nt(out + r * ldo + j * VW, acc[r][j]);
        return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) vstore(out + r * ldo + j * VW, acc[r][j]);
}

// One row (a decode of one sequence): the loop above would be a chain of dependent FMAs per
// accumulator; four interleaved partial sums (k mod 4) keep four chains in flight.
template <>
inline void micro_kernel<1>(const float* x, int64_t, const float* panel, int64_t K, const float* bias,
                            float* out, int64_t, Prefetch pf, bool nt) {
    constexpr int S = 4;
    vreg acc[S][NV];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[s][j] = s == 0 && bias ? vload(bias + j * VW) : vzero();
    int64_t k = 0;
    for (; k + S <= K; k += S) {
        const float* b = panel + k * NR;
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) {
            for (int line = 0; line < pf.lines; ++line) __builtin_prefetch(pf.base + (k + s) * pf.step + line * 64, 0, 3);
            const vreg a = vbroadcast(x[k + s]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) acc[s][j] = vfma(a, vload(b + s * NR + j * VW), acc[s][j]);
        }
    }
    for (; k < K; ++k) {
        const vreg a = vbroadcast(x[k]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[0][j] = vfma(a, vload(panel + k * NR + j * VW), acc[0][j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
        vreg sum = vfma(vbroadcast(1.0f), acc[1][j], acc[0][j]);
        sum = vfma(vbroadcast(1.0f), acc[2][j], sum);
        sum = vfma(vbroadcast(1.0f), acc[3][j], sum);
        if (nt)
            vstore_nt(out + j * VW, sum);
        else
            vstore(out + j * VW, sum);
    }
}

using MicroKernel = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, Prefetch, bool);

template <int... Rs>
constexpr auto make_table(std::integer_sequence<int, Rs...>) {
    return std::array<MicroKernel, sizeof...(Rs)>{&micro_kernel<Rs + 1>...};
}

const auto kKernels = make_table(std::make_integer_sequence<int, MR>{});

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---- bf16 weights and activations, fp32 accumulation: AVX512-BF16's vdpbf16ps ----
// One vdpbf16ps multiplies 16 pairs of bf16 and adds each pair's two products to one fp32
// lane: 32 multiply-adds per instruction against 16 for an fp32 FMA, and half the weight bytes
// to stream, which is what a decode step is bound by.
//
// Packed bf16 layout, same [N/NR, K, NR] shape as fp32 (so N and K read off the tensor alike):
// within panel p, k steps pair up as (k, k+1) for even k < K - K % 2, and element (k, c) lies
// at p*K*NR + (k/2)*2*NR + 2*c + k%2 (each lane's pair adjacent, as vdpbf16ps reads it); an
// odd K's last step is stored alone at p*K*NR + (K-1)*NR + c and widened to (w, 0) pairs.
//
// Numerics: x and W are bf16 values (exactly representable in fp32), each output is bias +
// the sum over k-pairs in increasing order of (x[k]w[k] + x[k+1]w[k+1]) accumulated in fp32,
// then rounded once to bf16 (round to nearest even). Against an fp32 matmul of the same bf16
// values that is the output's half-ulp of bf16 (2^-9 relative) plus fp32 summation error.
namespace bf16k {

constexpr int NV = 2, MR = 8, NR = NV * 16;
constexpr int kPrefetchPairs = 32;  // 4 KB ahead in a panel (128 bytes per k pair)

inline __m512 bias_load(const uint16_t* b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))), 16));
}
inline void store_bf16(uint16_t* out, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline __m512bh pair_of(const uint16_t* x, int64_t k) {
    uint32_t pair;
    __builtin_memcpy(&pair, x + k, 4);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(pair)));
}
inline __m512bh widened(const uint16_t* row) {  // 16 bf16 -> 16 (w, 0) pairs
    return reinterpret_cast<__m512bh>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))));
}
inline __m512bh wload(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

template <int R>
inline void micro_kernel(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const uint16_t* bias,
                         uint16_t* out, int64_t ldo, Prefetch pf) {
    __m512 acc[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int j = 0; j < NV; ++j) acc[r][j] = bias ? bias_load(bias + j * 16) : _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t q = 0; q < pairs; ++q) {
        const uint16_t* b = panel + q * 2 * NR;
        for (int line = 0; line < pf.lines; ++line) __builtin_prefetch(pf.base + q * pf.step + line * 64, 0, 3);
        __m512bh w[NV];
#pragma GCC unroll 2
        for (int j = 0; j < NV; ++j) w[j] = wload(b + j * 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512bh a = pair_of(x + r * ldx, 2 * q);
#pragma GCC unroll 2
            for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
        }
    }
    if (K % 2) {
        const uint16_t* b = panel + (K - 1) * NR;
        __m512bh w[NV];
        for (int j = 0; j < NV; ++j) w[j] = widened(b + j * 16);
        for (int r = 0; r < R; ++r) {
            const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(x[r * ldx + K - 1])));
            for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int j = 0; j < NV; ++j) store_bf16(out + r * ldo + j * 16, acc[r][j]);
}

// One row: four interleaved partial sums over k pairs (q mod 4), as the fp32 one-row kernel.
template <>
inline void micro_kernel<1>(const uint16_t* x, int64_t, const uint16_t* panel, int64_t K, const uint16_t* bias,
                            uint16_t* out, int64_t, Prefetch pf) {
    constexpr int S = 4;
    __m512 acc[S][NV];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 2
        for (int j = 0; j < NV; ++j) acc[s][j] = s == 0 && bias ? bias_load(bias + j * 16) : _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    int64_t q = 0;
    for (; q + S <= pairs; q += S) {
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) {
            for (int line = 0; line < pf.lines; ++line) __builtin_prefetch(pf.base + (q + s) * pf.step + line * 64, 0, 3);
            const __m512bh a = pair_of(x, 2 * (q + s));
            const uint16_t* b = panel + (q + s) * 2 * NR;
#pragma GCC unroll 2
            for (int j = 0; j < NV; ++j) acc[s][j] = _mm512_dpbf16_ps(acc[s][j], a, wload(b + j * 32));
        }
    }
    for (; q < pairs; ++q) {
        const __m512bh a = pair_of(x, 2 * q);
        for (int j = 0; j < NV; ++j) acc[0][j] = _mm512_dpbf16_ps(acc[0][j], a, wload(panel + q * 2 * NR + j * 32));
    }
    if (K % 2) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(x[K - 1])));
        for (int j = 0; j < NV; ++j) acc[0][j] = _mm512_dpbf16_ps(acc[0][j], a, widened(panel + (K - 1) * NR + j * 16));
    }
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j)
        store_bf16(out + j * 16, _mm512_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]), _mm512_add_ps(acc[2][j], acc[3][j])));
}

using MicroKernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, Prefetch);

template <int... Rs>
constexpr auto make_table(std::integer_sequence<int, Rs...>) {
    return std::array<MicroKernel, sizeof...(Rs)>{&micro_kernel<Rs + 1>...};
}

const auto kKernels = make_table(std::make_integer_sequence<int, MR>{});

// Two adjacent panels (64 output columns) times R <= MR2 rows: 4 weight vectors per k pair, so
// one broadcast of x feeds 4 vdpbf16ps instead of 2. With x in L2 (more than MR rows) the
// 8 x 2 kernel issues a broadcast per two dot products, which holds it ~5% below the
// instruction's rate; this one issues one per four (6 x 4 = 24 accumulators). Each output is
// the same sum in the same order as micro_kernel<R> (bias, then k pairs in increasing order,
// one accumulator), so results are bit-identical to the single-panel kernels'.
constexpr int MR2 = 6;

template <int R>
inline void micro_kernel2(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const uint16_t* bias,
                          uint16_t* out, int64_t ldo, Prefetch pf) {
    constexpr int NW = 2 * NV;
    const int64_t second = K * NR;  // the next panel, in elements
    __m512 acc[R][NW];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NW; ++j) acc[r][j] = bias ? bias_load(bias + j * 16) : _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t q = 0; q < pairs; ++q) {
        const uint16_t* b = panel + q * 2 * NR;
        for (int line = 0; line < pf.lines; ++line) __builtin_prefetch(pf.base + q * pf.step + line * 64, 0, 3);
        __m512bh w[NW];
#pragma GCC unroll 4
        for (int j = 0; j < NW; ++j) w[j] = wload(b + (j / NV) * second + (j % NV) * 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512bh a = pair_of(x + r * ldx, 2 * q);
#pragma GCC unroll 4
            for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
        }
    }
    if (K % 2) {
        const uint16_t* b = panel + (K - 1) * NR;
        __m512bh w[NW];
        for (int j = 0; j < NW; ++j) w[j] = widened(b + (j / NV) * second + (j % NV) * 16);
        for (int r = 0; r < R; ++r) {
            const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(x[r * ldx + K - 1])));
            for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NW; ++j) store_bf16(out + r * ldo + j * 16, acc[r][j]);
}

// One row keeps the single-panel four-way kernel (its sums are in a different order), per panel.
template <>
inline void micro_kernel2<1>(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const uint16_t* bias,
                             uint16_t* out, int64_t ldo, Prefetch pf) {
    micro_kernel<1>(x, ldx, panel, K, bias, out, ldo, pf);
    micro_kernel<1>(x, ldx, panel + K * NR, K, bias ? bias + NR : nullptr, out + NR, ldo, Prefetch{nullptr, 0, 0});
}

template <int... Rs>
constexpr auto make_table2(std::integer_sequence<int, Rs...>) {
    return std::array<MicroKernel, sizeof...(Rs)>{&micro_kernel2<Rs + 1>...};
}

const auto kKernels2 = make_table2(std::make_integer_sequence<int, MR2>{});

}  // namespace bf16k
#define PS_HAVE_BF16 1
#else
#define PS_HAVE_BF16 0
#endif

}  // namespace

extern "C" {

int ps_abi_version() { return kAbiVersion; }

int ps_gemm_panel_width() { return NR; }

// w: [N, K] with row stride ldw (floats); N a multiple of NR. packed: N * K floats.
void ps_gemm_pack(const float* w, int64_t ldw, int64_t N, int64_t K, float* packed) {
    const int64_t panels = N / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float* dst = packed + p * K * NR;
        for (int64_t c = 0; c < NR; ++c) {
            const float* src = w + (p * NR + c) * ldw;
            for (int64_t k = 0; k < K; ++k) dst[k * NR + c] = src[k];
        }
    }
}

// x: [M, K] with row stride ldx; packed from ps_gemm_pack; bias: [N] or null;
// out: [M, N] with row stride ldo. All fp32.
void ps_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const float* packed, int64_t N,
             const float* bias, float* out, int64_t ldo, int num_threads) {
    const int64_t panels = N / NR;
    // Rows of x per sweep over the weight: a prefill chunk of thousands of rows would otherwise
    // stream all of x through the cache once per panel. A block of rows (~1 MB, kept in L2)
    // meets every panel, then the next block: the weight is re-read once per block instead,
    // at M / MC times its size, which a block this tall amortises (>= 128 FLOP per weight byte).
    const int64_t mc_rows = std::max<int64_t>(MR, ((int64_t(1) << 18) / std::max<int64_t>(K, 1)) / MR * MR);
    // A parallel region costs a few microseconds: not worth it for a layer this small. A small x
    // is a weight stream (kParallelWeight), so the weight's size decides there, not the FLOPs.
    const bool parallel = num_threads > 1 && panels > 1 && (M * N * K >= (int64_t(1) << 18) || N * K >= kParallelWeight);
    const bool stream = M <= kStreamRows;
    // An output too large to stay in L2 (the LM head's logits: 4 MB at 32 rows of a 32000-word
    // vocabulary) is written with non-temporal stores: an ordinary store first reads each
    // output line in and later writes it back, through the caches the panels are streaming
    // through. Needs every tile's first column 64-byte aligned: out and its row stride.
    const bool nt = M * N * int64_t(sizeof(float)) >= kStreamOutBytes && reinterpret_cast<uintptr_t>(out) % 64 == 0 &&
                    (ldo * int64_t(sizeof(float))) % 64 == 0 && (NR * sizeof(float)) % 64 == 0;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
    for (int64_t m0 = 0; m0 < M; m0 += mc_rows) {
        const int64_t m1 = std::min(M, m0 + mc_rows);
        // Static split: each thread one contiguous run of panels, the same run for every row
        // block, so no thread waits for another between blocks (they share no output).
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; ++p) {
            const float* panel = packed + p * K * NR;
            const float* panel_bias = bias ? bias + p * NR : nullptr;
            const char* next = reinterpret_cast<const char*>(panel + K * NR);
            for (int64_t m = m0; m < m1; m += MR) {
                const int rows = int(std::min<int64_t>(MR, m1 - m));
                const int64_t pass = (m - m0) / MR;
                // The first pass over a panel reads it from memory (or L3): prefetch ahead in
                // it. Later passes find it in L1/L2, so the memory is idle: passes 1 and 2 fetch
                // the next panel (K x NR floats = 2K lines), one line per k step, so its own
                // first pass runs from L2.
                const Prefetch pf =
                    stream      ? Prefetch{nullptr, 0, 0}
                    : pass == 0 ? Prefetch{reinterpret_cast<const char*>(panel + kPrefetchRows * NR), NR * 4, NR * 4 / 64}
                    : pass <= 2 ? Prefetch{next + (pass - 1) * K * 64, 64, 1}
                                : Prefetch{nullptr, 0, 0};
                kKernels[rows - 1](x + m * ldx, ldx, panel, K, panel_bias, out + m * ldo + p * NR, ldo, pf, nt);
            }
        }
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    if (nt) _mm_sfence();  // this thread's streamed output visible before the region ends
#endif
    }
}

// The bf16 GEMM's panel width, or 0 where this build has no AVX512-BF16 (the compiler decided
// from -march=native: the CPU it was built for lacks it).
int ps_gemm_bf16_panel_width() { return PS_HAVE_BF16 ? 32 : 0; }

// w: [N, K] bf16 (as uint16) with row stride ldw; N a multiple of 32. packed: N * K bf16.
void ps_gemm_bf16_pack(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* packed) {
#if PS_HAVE_BF16
    constexpr int64_t NRB = bf16k::NR;
    const int64_t panels = N / NRB, even = K - K % 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        uint16_t* dst = packed + p * K * NRB;
        for (int64_t c = 0; c < NRB; ++c) {
            const uint16_t* src = w + (p * NRB + c) * ldw;
            for (int64_t k = 0; k < even; ++k) dst[(k / 2) * 2 * NRB + 2 * c + k % 2] = src[k];
            if (K % 2) dst[(K - 1) * NRB + c] = src[K - 1];
        }
    }
#else
    (void)w, (void)ldw, (void)N, (void)K, (void)packed;
#endif
}

// x: [M, K] bf16 with row stride ldx; packed from ps_gemm_bf16_pack; bias: [N] bf16 or null;
// out: [M, N] bf16 with row stride ldo. Threads split the panels, as in ps_gemm.
void ps_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                  const uint16_t* bias, uint16_t* out, int64_t ldo, int num_threads) {
#if PS_HAVE_BF16
    constexpr int64_t NRB = bf16k::NR, MRB = bf16k::MR;
    const int64_t panels = N / NRB;
    // Row blocks of ~512 KB of x (half the fp32 rows' bytes: the same rows per block as fp32).
    const int64_t mc_rows = std::max<int64_t>(MRB, ((int64_t(1) << 18) / std::max<int64_t>(K, 1)) / MRB * MRB);
    // As in ps_gemm: a one-row GEMM over a weight of >= kParallelWeight elements is a weight
    // stream that both cores read faster than one (at half fp32's bytes such a weight still
    // takes ~5 us to read against the team's ~1 us); up to MRB/2 rows no software prefetch
    // (the hardware prefetchers keep the linear panel read ahead); no barrier between row
    // blocks (static split, the same panels per thread in every block).
    const bool parallel = num_threads > 1 && panels > 1 && (M * N * K >= (int64_t(1) << 18) || N * K >= kParallelWeight);
    const bool stream = M <= MRB / 2;
    const int64_t panel_bytes = K * NRB * 2, pair_bytes = 2 * NRB * 2;
    // Three 8-row passes or more (x then lives in L2): panels go in pairs through the 6 x 64
    // kernel, an odd last panel alone through the 8 x 32 one; either way each thread has a
    // contiguous run. One thread, thread CPU time, 246M shapes, warm: 0.98-1.08x at M = 32,
    // +4-7% at 256 and 2,048 (~205 -> ~215 GFLOP/s, beside prepacked oneDNN's ~218 at 2,048);
    // cold 1.0-1.07x at 24-64 (benchmarks/README.md, "bf16 GEMM: small M and the prefill tile").
    const bool dual = M >= 3 * MRB;
    const int64_t units = dual ? (panels + 1) / 2 : panels;
#pragma omp parallel num_threads(num_threads) if (parallel)
    for (int64_t m0 = 0; m0 < M; m0 += mc_rows) {
        const int64_t m1 = std::min(M, m0 + mc_rows);
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; ++u) {
            if (dual && 2 * u + 1 < panels) {
                const int64_t p = 2 * u;
                const uint16_t* panel = packed + p * K * NRB;
                const uint16_t* panel_bias = bias ? bias + p * NRB : nullptr;
                const char* next = reinterpret_cast<const char*>(panel) + 2 * panel_bytes;
                const int64_t pairs = std::max<int64_t>(K / 2, 1);
                const int64_t half = (2 * panel_bytes / 64 + 1) / 2;
                // Pass 0 reads the pair from memory: 8 rows through the single-panel kernel on
                // each panel (8 rows of work per weight byte fetched; the 6-row pair kernel has
                // 6, and ran 4-6% slower with cold weights at M = 24-32, one thread); the other
                // rows then run from L2 through the pair kernel, whose passes 1 and 2 bring the
                // next pair into cache, as in the single-panel loop.
                const int64_t first = std::min<int64_t>(MRB, m1 - m0);
                for (int h = 0; h < 2; ++h) {
                    const uint16_t* half_panel = panel + h * K * NRB;
                    const Prefetch ahead{reinterpret_cast<const char*>(half_panel) + bf16k::kPrefetchPairs * pair_bytes, pair_bytes, int(pair_bytes / 64)};
                    bf16k::kKernels[first - 1](x + m0 * ldx, ldx, half_panel, K, panel_bias ? panel_bias + h * NRB : nullptr,
                                               out + m0 * ldo + (p + h) * NRB, ldo, ahead);
                }
                for (int64_t m = m0 + first; m < m1; m += bf16k::MR2) {
                    const int rows = int(std::min<int64_t>(bf16k::MR2, m1 - m));
                    const int64_t pass = 1 + (m - m0 - first) / bf16k::MR2;
                    const Prefetch pf = pass <= 2 ? Prefetch{next + (pass - 1) * half * 64, 64 * ((half + pairs - 1) / pairs), 1}
                                                  : Prefetch{nullptr, 0, 0};
                    bf16k::kKernels2[rows - 1](x + m * ldx, ldx, panel, K, panel_bias, out + m * ldo + p * NRB, ldo, pf);
                }
                continue;
            }
            const int64_t p = dual ? 2 * u : u;
            const uint16_t* panel = packed + p * K * NRB;
            const uint16_t* panel_bias = bias ? bias + p * NRB : nullptr;
            const char* next = reinterpret_cast<const char*>(panel) + panel_bytes;
            const int64_t pairs = std::max<int64_t>(K / 2, 1);
            for (int64_t m = m0; m < m1; m += MRB) {
                const int rows = int(std::min<int64_t>(MRB, m1 - m));
                const int64_t pass = (m - m0) / MRB;
                // As in ps_gemm: the first pass prefetches ahead in its own panel; passes 1 and 2
                // bring the next panel (panel_bytes / 64 lines) into L2, about one line per pair.
                const int64_t half = (panel_bytes / 64 + 1) / 2;
                const Prefetch pf =
                    stream      ? Prefetch{nullptr, 0, 0}
                    : pass == 0 ? Prefetch{reinterpret_cast<const char*>(panel) + bf16k::kPrefetchPairs * pair_bytes, pair_bytes, int(pair_bytes / 64)}
                    : pass <= 2 ? Prefetch{next + (pass - 1) * half * 64, 64 * ((half + pairs - 1) / pairs), 1}
                                : Prefetch{nullptr, 0, 0};
                bf16k::kKernels[rows - 1](x + m * ldx, ldx, panel, K, panel_bias, out + m * ldo + p * NRB, ldo, pf);
            }
        }
    }
#else
    (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)out, (void)ldo, (void)num_threads;
#endif
}

}  // extern "C"
