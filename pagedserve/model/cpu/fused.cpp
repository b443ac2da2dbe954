// The decoder layer's small elementwise ops, fused, for CPU tensors: RMSNorm, residual add +
// RMSNorm, SiLU(gate) * up and rotary embedding. Each replaces 3 to 14 torch ops whose dispatch
// (a few microseconds each) dominates them at decode sizes.
//
// Plain C++17 with a C ABI (no torch headers): pagedserve/model/cpu/fused.py builds it at first
// use through pagedserve/native.py and calls it through ctypes with raw data pointers.
//
// Invariant: every result equals, bit for bit, what the torch expressions in
// pagedserve/model/llama.py produce in the same dtype (SiLU: as HF runs it, on a contiguous
// gate; see silu_and_mul), except where a reduction or exp is computed in another order or by
// another implementation than torch's here: the RMSNorm mean of squares where no vector width
// reproduces torch's sum order (an ulp), the SiLU exp where torch's SLEEF expf is not found
// (SiLU then up to 4 ulps). So each torch op's rounding is reproduced: bf16 values widen to
// fp32 exactly (a shift), each torch op computes in fp32 and rounds to bf16 (round to nearest
// even) before the next one reads it; fp32 ops round to fp32 after every operation. The file
// is compiled without contraction into FMAs or reassociation (the pragmas below), which would
// skip an intermediate rounding torch performs.
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

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off) reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#endif

namespace {

constexpr int kAbiVersion = 2;
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

// torch's vectorised exp, as its Vectorized<float>::exp() calls it: SLEEF's expf16_u10 (AVX512
// capability) or expf8_u10 (AVX2), found in the loaded libtorch_cpu by fused.py and handed over
// once through ps_set_vector_exp. None: every exp is std::exp (torch's scalar SiLU's, and its
// DEFAULT capability's vector one).
void* g_vector_exp = nullptr;
int g_vector_exp_lanes = 0;

// One float vector's worth of the SiLU kernel per ISA: loads that widen T to fp32, stores that
// round fp32 to T (bf16: nearest even, a NaN stays a quiet NaN, as narrow<T>), and the SiLU
// expression in torch's vector kernel's order: x / (1 + exp(-x)), neg as a sign flip.
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
    static constexpr int kLanes = 16;
    using V = __m512;
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V load(const bf16* p) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    // The bf16 bits of v in the low 16 bits of each 32-bit lane.
    static __m512i bf16_bits(V v) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
        const __m512i rounded = _mm512_srli_epi32(biased, 16);
        const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet_nan);
    }
    static V round_to(float*, V v) { return v; }
    static V round_to(bf16*, V v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static void store(bf16* p, V v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
    }
    static V silu(V x) {
        const auto exp16 = reinterpret_cast<__m512 (*)(__m512)>(g_vector_exp);
        const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
        const V e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign)));
        return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
};
#endif

#if defined(__AVX2__)
struct Avx2 {
    static constexpr int kLanes = 8;
    using V = __m256;
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V load(const bf16* p) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    static __m256i bf16_bits(V v) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
        const __m256i rounded = _mm256_srli_epi32(biased, 16);
        const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        return _mm256_blendv_epi8(rounded, quiet_nan, nan);
    }
    static V round_to(float*, V v) { return v; }
    static V round_to(bf16*, V v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static void store(bf16* p, V v) {
        const __m256i bits = bf16_bits(v);  // each < 2^16: the unsigned saturating pack keeps it
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
    }
    static V silu(V x) {
        const auto exp8 = reinterpret_cast<__m256 (*)(__m256)>(g_vector_exp);
        const V e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
        return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
};
#endif

// The elements torch's F.silu computes with its scalar loop (std::exp) on a contiguous [rows,
// inter] gate, as HF's MLP has it, as flat index ranges [begin, end). TensorIterator runs one
// flat range per thread: one range when the tensor has at most GRAIN_SIZE elements or torch runs
// one thread, else at::parallel_for's split (min(threads, ceil(numel / GRAIN_SIZE)) chunks of
// ceil(numel / chunks)). Its vectorized_loop covers each range in blocks of two Vectorized
// (2 x 16 floats, or 2 x 32 bf16 under AVX512) and leaves the rest, fewer than one block at
// the range's end, to the scalar loop.
struct ScalarTails {
    static constexpr int kMax = 256;  // threads beyond this are not modelled (chunks capped)
    int count = 0;
    int64_t begin[kMax], end[kMax];
};

inline ScalarTails torch_scalar_tails(int64_t numel, int64_t block, int threads) {
    constexpr int64_t kGrainSize = 32768;  // at::internal::GRAIN_SIZE
    ScalarTails tails;
    int64_t chunks = 1;
    if (numel > kGrainSize && threads > 1) {
        chunks = std::min<int64_t>({threads, (numel + kGrainSize - 1) / kGrainSize, ScalarTails::kMax});
    }
    const int64_t chunk = (numel + chunks - 1) / chunks;
    for (int64_t start = 0; start < numel; start += chunk) {
        const int64_t stop = std::min(numel, start + chunk);
        const int64_t tail = start + (stop - start) / block * block;
        if (tail < stop) {
            tails.begin[tails.count] = tail;
            tails.end[tails.count] = stop;
            ++tails.count;
        }
    }
    return tails;
}

template <typename T>
inline T scalar_silu_mul(T gate, T up) {
    const float g = widen(gate);
    return narrow<T>(round_to<T>(g / (1.0f + std::exp(-g))) * widen(up));
}

// One row with torch's vector exp: whole vectors straight from the row, the last partial one
// through zero-padded copies, then the elements in torch's scalar tails (flat indices from
// `flat`) redone with std::exp. Software prefetch ~2 KiB ahead on the gate and up streams: at
// prefill sizes it halved the time (246M's M=2048 fp32, one thread: 6.3 -> 2.5 ms, about
// what torch.mul moves the same bytes in); the exp calls leave the hardware prefetchers behind.
template <class Isa, typename T>
void silu_and_mul_row(const T* gate, const T* up, T* o, int64_t inter, int64_t flat, const ScalarTails& tails) {
    constexpr int64_t kLanes = Isa::kLanes;
    constexpr int64_t kAhead = 2048 / sizeof(T);
    int64_t i = 0;
    for (; i + kLanes <= inter; i += kLanes) {
        __builtin_prefetch(gate + i + kAhead);
        __builtin_prefetch(up + i + kAhead);
        const auto s = Isa::round_to(static_cast<T*>(nullptr), Isa::silu(Isa::load(gate + i)));
        Isa::store(o + i, Isa::mul(s, Isa::load(up + i)));
    }
    if (i < inter) {
        T g[kLanes] = {}, u[kLanes] = {}, out[kLanes];
        std::memcpy(g, gate + i, (inter - i) * sizeof(T));
        std::memcpy(u, up + i, (inter - i) * sizeof(T));
        const auto s = Isa::round_to(static_cast<T*>(nullptr), Isa::silu(Isa::load(g)));
        Isa::store(out, Isa::mul(s, Isa::load(u)));
        std::memcpy(o + i, out, (inter - i) * sizeof(T));
    }
    for (int t = 0; t < tails.count; ++t) {
        const int64_t lo = std::max(tails.begin[t], flat) - flat, hi = std::min(tails.end[t], flat + inter) - flat;
        for (int64_t j = lo; j < hi; ++j) o[j] = scalar_silu_mul(gate[j], up[j]);
    }
}

// One row with std::exp for every element: torch's scalar SiLU, and its vector one under the
// DEFAULT capability. In chunks: the scalar exp first, then the rest of the element's work in a
// loop the compiler vectorises (in one loop the exp call kept the bf16 widening and rounding
// scalar too: 1.6x the fp32 op's time at 246M's shapes).
template <typename T>
void silu_and_mul_row_scalar(const T* gate, const T* up, T* o, int64_t inter) {
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

// out = silu(gate) * up with gate = x[:, :inter], up = x[:, inter:]: F.silu rounds to T
// (computed as g / (1 + exp(-g)) in fp32, as torch's kernel does), then the product rounds to T.
// With torch's vector exp (ps_set_vector_exp) each element's exp is the one torch used for it
// on HF's contiguous gate: SLEEF's in vector lanes, std::exp in the scalar tails that
// torch_scalar_tails finds for `threads` threads (torch's own count; the caller passes it).
template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t rows, int64_t inter,
                  int threads) {
    const int lanes = g_vector_exp_lanes;
    // torch's block: two Vectorized<T>; a Vectorized<BFloat16> holds twice the floats' lanes.
    const int64_t block = int64_t{2} * lanes * (sizeof(T) == 2 ? 2 : 1);
    const ScalarTails tails = lanes > 0 ? torch_scalar_tails(rows * inter, block, threads) : ScalarTails{};
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel_worth_it(rows, rows * inter, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = x + r * x_stride;
        const T* up = gate + inter;
        T* o = out + r * out_stride;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (lanes == 16) {
            silu_and_mul_row<Avx512>(gate, up, o, inter, r * inter, tails);
            continue;
        }
#endif
#if defined(__AVX2__)
        if (lanes == 8) {
            silu_and_mul_row<Avx2>(gate, up, o, inter, r * inter, tails);
            continue;
        }
#endif
        silu_and_mul_row_scalar(gate, up, o, inter);
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

// Hands over torch's vectorised expf (see silu_and_mul): `lanes` 16 for SLEEF's expf16_u10, 8
// for expf8_u10, 0 (or a null `fn`) for std::exp everywhere. Returns 0, or -1 when this build
// cannot call a function of that width (then std::exp stays). Call before any kernel runs.
int ps_set_vector_exp(int lanes, void* fn) {
    bool callable = fn == nullptr || lanes == 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    callable = callable || lanes == 16;
#endif
#if defined(__AVX2__)
    callable = callable || lanes == 8;
#endif
    if (!callable) return -1;
    g_vector_exp = fn == nullptr ? nullptr : fn;
    g_vector_exp_lanes = fn == nullptr ? 0 : lanes;
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
