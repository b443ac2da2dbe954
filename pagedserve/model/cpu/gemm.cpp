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

constexpr int kAbiVersion = 1;

#if defined(__AVX512F__)
constexpr int VW = 16;
using vreg = __m512;
inline vreg vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vreg v) { _mm512_storeu_ps(p, v); }
inline vreg vbroadcast(float a) { return _mm512_set1_ps(a); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm512_fmadd_ps(a, b, c); }
inline vreg vzero() { return _mm512_setzero_ps(); }
constexpr int NV = 2, MR = 8;  // 16 accumulators of the 32 vector registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
using vreg = __m256;
inline vreg vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vreg v) { _mm256_storeu_ps(p, v); }
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
constexpr int NV = 2, MR = 4;
#endif

constexpr int NR = NV * VW;
constexpr int kPrefetchRows = 32;  // k steps ahead: 4 KB of an AVX-512 panel

// R rows of x (R <= MR) times one packed panel: out[r, 0:NR] = bias + x[r, :] . panel.
// Prefetch plan of one pass: at k step k, `lines` cache lines from base + k * step bytes.
struct Prefetch {
    const char* base;
    int64_t step;
    int lines;
};

template <int R>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                         float* out, int64_t ldo, Prefetch pf) {
    vreg acc[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[r][j] = bias ? vload(bias + j * VW) : vzero();
    for (int64_t k = 0; k < K; ++k) {
        const float* b = panel + k * NR;
        for (int line = 0; line < pf.lines; ++line) __builtin_prefetch(pf.base + k * pf.step + line * 64, 0, 3);
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
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) vstore(out + r * ldo + j * VW, acc[r][j]);
}

// One row (a decode of one sequence): the loop above would be a chain of dependent FMAs per
// accumulator; four interleaved partial sums (k mod 4) keep four chains in flight.
template <>
inline void micro_kernel<1>(const float* x, int64_t, const float* panel, int64_t K, const float* bias,
                            float* out, int64_t, Prefetch pf) {
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
        vstore(out + j * VW, sum);
    }
}

using MicroKernel = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, Prefetch);

template <int... Rs>
constexpr auto make_table(std::integer_sequence<int, Rs...>) {
    return std::array<MicroKernel, sizeof...(Rs)>{&micro_kernel<Rs + 1>...};
}

const auto kKernels = make_table(std::make_integer_sequence<int, MR>{});

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
    // A parallel region costs a few microseconds: not worth it for a layer this small.
    const bool parallel = num_threads > 1 && panels > 1 && M * N * K >= (int64_t(1) << 18);
#pragma omp parallel num_threads(num_threads) if (parallel)
    for (int64_t m0 = 0; m0 < M; m0 += mc_rows) {
        const int64_t m1 = std::min(M, m0 + mc_rows);
#pragma omp for schedule(static)
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
                    pass == 0   ? Prefetch{reinterpret_cast<const char*>(panel + kPrefetchRows * NR), NR * 4, NR * 4 / 64}
                    : pass <= 2 ? Prefetch{next + (pass - 1) * K * 64, 64, 1}
                                : Prefetch{nullptr, 0, 0};
                kKernels[rows - 1](x + m * ldx, ldx, panel, K, panel_bias, out + m * ldo + p * NR, ldo, pf);
            }
        }
    }
}

}  // extern "C"
