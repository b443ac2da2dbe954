// The decoder layer's small elementwise ops, fused, for CPU tensors: RMSNorm, residual add +
// RMSNorm, SiLU(gate) * up and rotary embedding. Each replaces 3 to 14 torch ops whose dispatch
// (a few microseconds each) dominates them at decode sizes.
//
// Plain C++17 with a C ABI (no torch headers): pagedserve/model/cpu/fused.py builds it at first
// use through pagedserve/native.py and calls it through ctypes with raw data pointers.
//
// Invariant: every result equals, bit for bit, what the torch expressions in
// pagedserve/model/llama.py produce in the same dtype, except where a reduction or exp is
// computed in another order or by another implementation (the RMSNorm mean of squares, the
// SiLU exp): there a float32 intermediate may differ by an ulp. So each torch op's rounding is
// reproduced: bf16 values widen to fp32 exactly (a shift), each torch op computes in fp32 and
// rounds to bf16 (round to nearest even) before the next one reads it; fp32 ops round to fp32
// after every operation. The file is compiled without contraction into FMAs or reassociation
// (the pragmas below), which would skip an intermediate rounding torch performs.
//
// Layout: 2-D inputs are `rows` rows of contiguous elements, each row starting `stride`
// elements after the previous (a split or sliced view needs no copy). Rotary q / k are
// [rows, heads, head_dim] with a row stride and a head stride, head_dim contiguous; cos / sin are
// [rows, head_dim] with a row stride. Threads: rows are split across `threads` OpenMP threads
// only when the call has enough elements to pay for a parallel region (kParallelMinElements).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__clang__)
#pragma clang fp contract(off) reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#endif

namespace {

constexpr int kAbiVersion = 1;
constexpr int64_t kParallelMinElements = 1 << 15;  // below this a parallel region costs more than it saves

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

struct bf16 {
    uint16_t bits;
};

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
    const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Narrowing to the activation dtype: torch's rounding (nearest, ties to even; NaN stays NaN).
// Written with a select rather than a branch so loops over it vectorise.
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline bf16 narrow<bf16>(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return bf16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
}
// One torch op's result in dtype T, read back as fp32 for the next op.
template <typename T>
inline float round_to(float x) { return widen(narrow<T>(x)); }

inline bool parallel_worth_it(int64_t rows, int64_t elements, int threads) {
    return threads > 1 && rows > 1 && elements >= kParallelMinElements;
}

// torch's summation order, so the mean of squares equals torch's bit for bit: torch sums a
// contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum) as Vectorized<float>
// vectors of `Lanes` floats (which width its sum kernel uses varies by build and CPU: fused.py
// finds it by comparing ps_sum_of_squares with torch's sum at load), 4
// interleaved accumulators (vector i*4 + k into accumulator k) cascaded over 4 levels of
// 2^level_power steps, the leftover vectors into accumulator 0, the accumulators folded 0+1+2+3,
// then a scalar sum of the leftover elements plus each lane in turn. A row shorter than one
// vector is summed the same way with 1-float "vectors" and no lane fold.
inline int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = static_cast<uint64_t>(x) - 1; v != 0; v >>= 1) ++bits;
    return bits;
}

template <int Lanes, typename T>
inline void square_into(float* acc, const T* x) {
    for (int l = 0; l < Lanes; ++l) {
        const float v = widen(x[l]);
        acc[l] += v * v;
    }
}

// torch's row_sum (multi_row_sum with 4 rows, then the leftovers and the fold) over `count`
// vectors of Lanes elements starting at x; the result's Lanes partial sums land in `out`.
template <int Lanes, typename T>
inline void cascade_row_sum(const T* x, int64_t count, float* out) {
    constexpr int kLevels = 4, kRows = 4;
    const int64_t size = count / kRows;
    const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
    const int64_t level_step = int64_t{1} << level_power;
    const int64_t level_mask = level_step - 1;
    float acc[kLevels][kRows][Lanes] = {};
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; ++j, ++i) {
            for (int k = 0; k < kRows; ++k) square_into<Lanes>(acc[0][k], x + (i * kRows + k) * Lanes);
        }
        for (int j = 1; j < kLevels; ++j) {
            for (int k = 0; k < kRows; ++k) {
                for (int l = 0; l < Lanes; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; ++i) {
        for (int k = 0; k < kRows; ++k) square_into<Lanes>(acc[0][k], x + (i * kRows + k) * Lanes);
    }
    for (int j = 1; j < kLevels; ++j) {
        for (int k = 0; k < kRows; ++k) {
            for (int l = 0; l < Lanes; ++l) acc[0][k][l] += acc[j][k][l];
        }
    }
    for (int64_t v = size * kRows; v < count; ++v) square_into<Lanes>(acc[0][0], x + v * Lanes);
    for (int k = 1; k < kRows; ++k) {
        for (int l = 0; l < Lanes; ++l) acc[0][0][l] += acc[0][k][l];
    }
    for (int l = 0; l < Lanes; ++l) out[l] = acc[0][0][l];
}

template <int Lanes, typename T>
inline float sum_of_squares(const T* x, int64_t n) {
    if (n < Lanes) {
        float total;
        cascade_row_sum<1>(x, n, &total);
        return total;
    }
    const int64_t vectors = n / Lanes;
    float lanes[Lanes];
    cascade_row_sum<Lanes>(x, vectors, lanes);
    float total = 0.0f;
    for (int64_t i = vectors * Lanes; i < n; ++i) {
        const float v = widen(x[i]);
        total += v * v;
    }
    for (int l = 0; l < Lanes; ++l) total += lanes[l];
    return total;
}

template <typename T>
inline float sum_of_squares(const T* x, int64_t n, int lanes) {
    return lanes == 16 ? sum_of_squares<16>(x, n) : lanes == 4 ? sum_of_squares<4>(x, n) : sum_of_squares<8>(x, n);
}

// pagedserve's RMSNorm on one row: x32 * rsqrt(mean(x32^2) + eps) in fp32, rounded to T, then
// times the weight as a T op (weight * normed, rounded to T).
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps, int lanes) {
    const float mean = sum_of_squares(x, n, lanes) / static_cast<float>(n);
    const float inv_rms = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < n; ++i) {
        const float normed = round_to<T>(widen(x[i]) * inv_rms);
        out[i] = narrow<T>(widen(weight[i]) * normed);
    }
}

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* weight, T* out, int64_t out_stride, int64_t rows,
              int64_t cols, float eps, int lanes, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel_worth_it(rows, rows * cols, threads))
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_stride, weight, out + r * out_stride, cols, eps, lanes);
}

// residual = residual + x as a T op (in place), then out = rms_norm(residual): the unfused
// `h = h + f(...)` followed by the next layer's norm of h.
template <typename T>
void add_rms_norm(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight, T* out,
                  int64_t out_stride, int64_t rows, int64_t cols, float eps, int lanes, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel_worth_it(rows, rows * cols, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * x_stride;
        T* res = residual + r * res_stride;
        for (int64_t i = 0; i < cols; ++i) res[i] = narrow<T>(widen(res[i]) + widen(xr[i]));
        rms_norm_row(res, weight, out + r * out_stride, cols, eps, lanes);
    }
}

// out = silu(gate) * up with gate = x[:, :inter], up = x[:, inter:]: F.silu rounds to T
// (computed as g / (1 + exp(-g)) in fp32, as torch's kernel does), then the product rounds to T.
template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t rows, int64_t inter,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel_worth_it(rows, rows * inter, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = x + r * x_stride;
        const T* up = gate + inter;
        T* o = out + r * out_stride;
        // In chunks: the scalar exp first (std::exp, torch's scalar SiLU's), then the rest of the
        // element's work in a loop the compiler vectorises (in one loop the exp call kept the bf16
        // widening and rounding scalar too: 1.6x the fp32 op's time at 246M's shapes).
        constexpr int64_t kChunk = 256;
        float e[kChunk];
        for (int64_t c = 0; c < inter; c += kChunk) {
            const int64_t n = std::min(kChunk, inter - c);
            for (int64_t j = 0; j < n; ++j) e[j] = std::exp(-widen(gate[c + j]));
            for (int64_t j = 0; j < n; ++j) {
                const float silu = round_to<T>(widen(gate[c + j]) / (1.0f + e[j]));
                o[c + j] = narrow<T>(silu * widen(up[c + j]));
            }
        }
    }
}

// x = x * cos + rotate_half(x) * sin on one head, in place, with rotate_half(x) = cat(-x2, x1):
// three rounded T ops (two products, one sum) per element, as torch evaluates the expression.
// (__restrict: q / k never alias cos / sin; without it the bf16 loop did not vectorise, 13x the
// fp32 one's time at 246M's shapes.)
template <typename T>
inline void rotate_head(T* __restrict x, const T* __restrict cos, const T* __restrict sin, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = widen(x[i]), x2 = widen(x[i + half]);
        const float lo = round_to<T>(x1 * widen(cos[i])) + round_to<T>(-x2 * widen(sin[i]));
        const float hi = round_to<T>(x2 * widen(cos[i + half])) + round_to<T>(x1 * widen(sin[i + half]));
        x[i] = narrow<T>(lo);
        x[i + half] = narrow<T>(hi);
    }
}

template <typename T>
void rotary(T* q, int64_t q_row_stride, int64_t q_head_stride, int64_t q_heads, T* k, int64_t k_row_stride,
            int64_t k_head_stride, int64_t k_heads, const T* cos, int64_t cos_stride, const T* sin,
            int64_t sin_stride, int64_t rows, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
    const int64_t elements = rows * (q_heads + k_heads) * head_dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel_worth_it(rows, elements, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + r * cos_stride;
        const T* s = sin + r * sin_stride;
        for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + r * q_row_stride + h * q_head_stride, c, s, half);
        for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + r * k_row_stride + h * k_head_stride, c, s, half);
    }
}

}  // namespace

extern "C" {

int ps_abi_version() { return kAbiVersion; }

// The sum of x[i]^2 in torch's order for `lanes` (16, 8 or 4) floats per vector: the probe that
// finds the width torch's sum kernel uses here.
float ps_sum_of_squares(const float* x, int64_t n, int lanes) { return sum_of_squares(x, n, lanes); }

// Each kernel returns 0, or -1 for a dtype code it does not know (nothing written). `lanes`:
// the float width of torch's sum kernel here (16, 8 or 4), which fixes the order of its sums.
int ps_rms_norm(int dtype, const void* x, int64_t x_stride, const void* weight, void* out, int64_t out_stride,
                int64_t rows, int64_t cols, float eps, int lanes, int threads) {
    if (dtype == kFloat32) {
        rms_norm(static_cast<const float*>(x), x_stride, static_cast<const float*>(weight), static_cast<float*>(out),
                 out_stride, rows, cols, eps, lanes, threads);
    } else if (dtype == kBFloat16) {
        rms_norm(static_cast<const bf16*>(x), x_stride, static_cast<const bf16*>(weight), static_cast<bf16*>(out),
                 out_stride, rows, cols, eps, lanes, threads);
    } else {
        return -1;
    }
    return 0;
}

int ps_add_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, int64_t res_stride,
                    const void* weight, void* out, int64_t out_stride, int64_t rows, int64_t cols, float eps,
                    int lanes, int threads) {
    if (dtype == kFloat32) {
        add_rms_norm(static_cast<const float*>(x), x_stride, static_cast<float*>(residual), res_stride,
                     static_cast<const float*>(weight), static_cast<float*>(out), out_stride, rows, cols, eps, lanes, threads);
    } else if (dtype == kBFloat16) {
        add_rms_norm(static_cast<const bf16*>(x), x_stride, static_cast<bf16*>(residual), res_stride,
                     static_cast<const bf16*>(weight), static_cast<bf16*>(out), out_stride, rows, cols, eps, lanes, threads);
    } else {
        return -1;
    }
    return 0;
}

int ps_silu_and_mul(int dtype, const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t rows,
                    int64_t inter, int threads) {
    if (dtype == kFloat32) {
        silu_and_mul(static_cast<const float*>(x), x_stride, static_cast<float*>(out), out_stride, rows, inter,
                     threads);
    } else if (dtype == kBFloat16) {
        silu_and_mul(static_cast<const bf16*>(x), x_stride, static_cast<bf16*>(out), out_stride, rows, inter, threads);
    } else {
        return -1;
    }
    return 0;
}

int ps_rotary(int dtype, void* q, int64_t q_row_stride, int64_t q_head_stride, int64_t q_heads, void* k,
              int64_t k_row_stride, int64_t k_head_stride, int64_t k_heads, const void* cos, int64_t cos_stride,
              const void* sin, int64_t sin_stride, int64_t rows, int64_t head_dim, int threads) {
    if (dtype == kFloat32) {
        rotary(static_cast<float*>(q), q_row_stride, q_head_stride, q_heads, static_cast<float*>(k), k_row_stride,
               k_head_stride, k_heads, static_cast<const float*>(cos), cos_stride, static_cast<const float*>(sin),
               sin_stride, rows, head_dim, threads);
    } else if (dtype == kBFloat16) {
        rotary(static_cast<bf16*>(q), q_row_stride, q_head_stride, q_heads, static_cast<bf16*>(k), k_row_stride,
               k_head_stride, k_heads, static_cast<const bf16*>(cos), cos_stride, static_cast<const bf16*>(sin),
               sin_stride, rows, head_dim, threads);
    } else {
        return -1;
    }
    return 0;
}

}  // extern "C"
