// Paged attention for CPU tensors, reading K/V where they lie in the block pool.
//
// Plain C++17 with a C ABI (no torch headers): pagedserve/attention/cpu_kernel.py compiles it
// at first use with the system compiler (-O3 -march=native -fopenmp) and calls it through
// ctypes with raw data pointers. Under torch the OpenMP runtime it links is torch's own
// libgomp (same SONAME, already loaded), so its threads are torch's threads.
//
// Layout (one layer): key `offset` of block `block_id`, kv head `g` starts at element
// block_id * block_stride + g * head_stride + offset * token_stride of k_cache (v_cache alike),
// its head_dim elements contiguous; pagedserve's pool [num_slots, kv_heads, head_dim] has
// token_stride = kv_heads * head_dim, head_stride = head_dim, block_stride = block_size *
// token_stride. q and out are [tokens, num_heads, head_dim] with heads contiguous and a row
// stride per token. Query heads h use kv head h / (num_heads / num_kv_heads).
//
// Quantized caches (kv_cache_dtype fp8_e4m3 / fp8_e5m2 / int8, see attention/kv_quant.py): one
// byte per value; a value reads as decode(byte) x scale, where the scale is one float per layer
// for K and one for V (fp8), or one float per (slot, kv head) from a scales array laid out
// [num_slots, kv_heads] (int8). fp8 bytes decode by bit arithmetic (decode_fp8), so no
// compiler's float8 type is needed. q and out are then fp32.
//
// Work: a "sequence" of the plan is q_len query rows (a decode is 1 row, a prefill chunk many)
// whose last row sees ctx_len keys. Row j sits at position ctx_len - q_len + j and attends to
// keys in [max(0, pos - window + 1), pos] (window 0 = unlimited). One work item is a tile of rows
// of one sequence over a range of key blocks, for all kv heads (each block's token rows read
// whole) or, when that leaves too few items for the threads, for one kv head: every query head
// of a GQA group shares each K/V row it loads. Softmax is online (running max m, sum l,
// accumulator acc), all in fp32 whatever the storage type. When there are too few items for the
// threads (one long decode), a sequence's key blocks are split into partitions whose (m, l, acc)
// are merged after. K/V of blocks ahead are prefetched into L2 (the block table says where).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

// Prefetch distance (blocks) and locality hint (__builtin_prefetch's third argument: 1 =
// prefetcht2, into L2), overridable with -D only to measure them (benchmarks/README.md).
#ifndef PS_PREFETCH_BLOCKS
#define PS_PREFETCH_BLOCKS 2
#endif
#ifndef PS_PF_LOC
#define PS_PF_LOC 1
#endif

namespace {

constexpr int kAbiVersion = 6;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4, kInt8 = 5 };

struct bf16 {
    uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(bf16* dst, float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN (rounding could carry it to inf)
        dst->bits = static_cast<uint16_t>((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even, as torch does
    dst->bits = static_cast<uint16_t>(u >> 16);
}
#ifdef __FLT16_MAX__
using f16 = _Float16;
inline float to_float(f16 x) { return static_cast<float>(x); }
inline void store(f16* dst, float x) { *dst = static_cast<f16>(x); }
#endif

// One-byte cache types: the value a byte stands for before its scale.
struct fp8_e4m3 {
    uint8_t bits;
};
struct fp8_e5m2 {
    uint8_t bits;
};

// The float an 8-bit float's bits encode: 1 sign bit, `kExpBits` exponent bits with `kBias`, the
// rest mantissa. E4M3 (OCP "fn": no infinities) spends only S.1111.111 on NaN, so its exponent
// 15 holds normal numbers up to 448; E5M2 is IEEE-like (exponent 31: infinity / NaN).
// Integer arithmetic, an int-to-float conversion and a multiply by a power of two built from
// the exponent bits (always a normal float: the smallest is 2^-16), with selects for sign and
// specials, so a tile's decode loop vectorises; a 256-entry table read per byte does not (it
// made fp8 attention 3.7x slower than int8's plain conversion).
template <int kExpBits, int kBias, bool kIeeeSpecial>
inline float decode_fp8(uint32_t bits) {
    constexpr int kManBits = 7 - kExpBits;
    constexpr uint32_t kExpMask = (1u << kExpBits) - 1, kManMask = (1u << kManBits) - 1;
    const uint32_t e = (bits >> kManBits) & kExpMask, m = bits & kManMask;
    const uint32_t significand = e != 0 ? (m | (1u << kManBits)) : m;  // subnormals: no implicit 1
    const int32_t exponent = static_cast<int32_t>(e != 0 ? e : 1u) - kBias - kManBits;
    const uint32_t pow2_bits = static_cast<uint32_t>(exponent + 127) << 23;
    float pow2;
    std::memcpy(&pow2, &pow2_bits, sizeof pow2);
    float magnitude = static_cast<float>(significand) * pow2;
    if constexpr (kIeeeSpecial) {
        const float special = m != 0 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
        magnitude = e == kExpMask ? special : magnitude;
    } else {
        magnitude = (e == kExpMask && m == kManMask) ? std::numeric_limits<float>::quiet_NaN() : magnitude;
    }
    return (bits & 0x80u) != 0 ? -magnitude : magnitude;
}

template <typename KT>
constexpr bool is_quantized() {
    return std::is_same_v<KT, fp8_e4m3> || std::is_same_v<KT, fp8_e5m2> || std::is_same_v<KT, int8_t>;
}
inline float decode(fp8_e4m3 x) { return decode_fp8<4, 7, false>(x.bits); }
inline float decode(fp8_e5m2 x) { return decode_fp8<5, 15, true>(x.bits); }
inline float decode(int8_t x) { return static_cast<float>(x); }

// The scale of each row of a quantized tile: per_token[t * stride] if given (int8), else `value`.
struct RowScales {
    const float* per_token;
    int64_t stride;
    float value;
};

// exp for x <= 0 (softmax after subtracting the running max), written so loops over it
// vectorise: 2^n * e^r with |r| <= ln2/2 and a degree-7 Taylor polynomial (relative error
// below 1e-8, under fp32 rounding). Inputs below -87 are clamped: e^-87 is ~1e-38, which
// counts for nothing next to the row maximum's weight of 1.
inline float fast_exp(float x) {
    x = std::max(x, -87.0f);
    x = std::min(x, 88.0f);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

}  // namespace

extern "C" {

// What the Python side fills once per step (ctypes.Structure of the same layout).
struct PsAttentionPlan {
    int64_t num_seqs;
    const int32_t* q_start;      // [num_seqs] first row of the sequence in q / out
    const int32_t* q_len;        // [num_seqs] query rows
    const int32_t* ctx_len;      // [num_seqs] keys the last row sees (cached + new)
    const int32_t* block_table;  // [num_seqs, table_stride] block ids
    int64_t table_stride;
    int64_t block_size;
    int64_t sliding_window;      // 0 = none
};

}  // extern "C"

namespace {

struct Shape {
    int64_t num_heads, num_kv_heads, head_dim, group;
    int64_t q_row_stride, out_row_stride;
    int64_t block_stride, head_stride, token_stride;  // cache element strides
    float scale;
    // Quantized caches: per-(slot, kv head) scales [num_slots, kv_heads] with `scale_token_stride`
    // floats between slots (nullptr = none), else one scale for all of K and one for all of V.
    const float* k_scales = nullptr;
    const float* v_scales = nullptr;
    int64_t scale_token_stride = 0;
    float k_scale = 1.0f, v_scale = 1.0f;
};

struct Item {
    int32_t seq, row0, nrows, kv_head, num_kv;  // kv heads [kv_head, kv_head + num_kv)
    int32_t key_lo, key_hi;  // key positions this item covers
    int64_t partial;         // index of its partial result, -1 = writes out directly
    int64_t cost;
};

constexpr int kMaxTileVectors = 64;      // query vectors (rows x group heads) per item
constexpr int64_t kMinPartitionKeys = 256;
constexpr int64_t kMinParallelWork = 16384;  // (query head, key) pairs: ~20 us of work

inline int64_t row_pos(const PsAttentionPlan& p, int s, int j) { return p.ctx_len[s] - p.q_len[s] + j; }
inline int64_t row_floor(const PsAttentionPlan& p, int64_t pos) {
    return p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
}

// Thread-local scratch: the query vectors, accumulators and one tile of scores.
template <typename T>
struct Scratch {
    std::vector<T> buf;
    T* get(size_t n) {
        if (buf.size() < n) buf.resize(n);
        return buf.data();
    }
};
thread_local Scratch<float> tls_floats;
thread_local Scratch<int64_t> tls_ints;

// 16 fp32 lanes in GCC/Clang's portable vector extension: one zmm register with AVX-512, two
// ymm with AVX2, four xmm with SSE or NEON; the compiler picks for the CPU it targets.
typedef float v16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;
inline v16 load16(const float* p) {
    v16 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
// x as computed, rounded: the compiler may not fuse the product that made it into a later add
// (an FMA would round once where the unfolded code rounded twice, and move outputs' last bits).
// In a register where one holds a v16 (AVX-512), else through memory (portable to any target).
template <typename T>
inline T keep_rounded(T x) {
#if defined(__x86_64__) && defined(__AVX512F__)
    asm("" : "+v"(x));
#else
    asm("" : "+m"(x));
#endif
    return x;
}
// 16 elements at p as fp32 lanes: bf16 widened exactly (its bits are a float's top half).
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
inline v16 loadv(const float* p) { return load16(p); }
inline v16 loadv(const bf16* p) {
    v16h h;
    std::memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16 x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
#if defined(__clang__) || __GNUC__ >= 12
#define PS_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC before 12 (Ubuntu 22.04's 11) has only the mask-vector form
typedef int32_t v16i __attribute__((vector_size(64)));
#define PS_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v16i{__VA_ARGS__})
#endif

// Lane t of the result = the sum of the 16 lanes of in[kSlot[t]]: sixteen horizontal sums for
// the price of about three vector operations each (a transpose folded into the adds), instead
// of a reduction tree per dot product.
constexpr int kSlot[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline v16 sum_lanes_16(const v16* in) {
    v16 c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)
        c[i] = PS_SHUFFLE(in[2 * i], in[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PS_SHUFFLE(in[2 * i], in[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        d[i] = PS_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               PS_SHUFFLE(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        e[i] = PS_SHUFFLE(d[2 * i], d[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               PS_SHUFFLE(d[2 * i], d[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return PS_SHUFFLE(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           PS_SHUFFLE(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// Rows [0, n) of a tile of K or V as fp32 rows of `padded` floats (zeros past head_dim):
// read in place when the cache already is fp32 and rows are whole vectors, else converted.
template <typename KT>
const float* tile_rows(const KT* first, int64_t token_stride, int64_t n, int64_t dh, int64_t padded,
                       float* scratch, int64_t& stride_out, const RowScales& scales) {
    if constexpr (std::is_same_v<KT, float>) {
        if (dh == padded) {
            stride_out = token_stride;
            return first;
        }
    }
    for (int64_t t = 0; t < n; ++t) {
        const KT* src = first + t * token_stride;
        float* dst = scratch + t * padded;
        if constexpr (is_quantized<KT>()) {
            const float s = scales.per_token != nullptr ? scales.per_token[t * scales.stride] : scales.value;
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) dst[d] = decode(src[d]) * s;
        } else {
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) dst[d] = to_float(src[d]);
        }
        for (int64_t d = dh; d < padded; ++d) dst[d] = 0.0f;
    }
    stride_out = padded;
    return scratch;
}

// K/V lines asked for ahead, a few at a time while a tile computes: `runs` runs of `span` bytes,
// `stride` bytes apart, in K and V alike. (A burst of a hundred prefetches holds up the core
// until the memory system has taken most of them; spread over the score loop they overlap it.)
struct Ahead {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t span = 0, stride = 0, runs = 0;
    int64_t run = 0, off = 0;  // the next line
    inline void step() {       // one line of K and one of V
        if (run >= runs) return;
        __builtin_prefetch(k + run * stride + off, 0, PS_PF_LOC);
        __builtin_prefetch(v + run * stride + off, 0, PS_PF_LOC);
        off += 64;
        if (off >= span) {
            off = 0;
            ++run;
        }
    }
    void drain() {
        while (run < runs) step();
    }
};

// The scores, softmax update and P.V of one tile of n <= 16 keys (starting at key position
// `tile`) for the R = nrows * G query vectors of one kv head. kt / vt: the tile's K and V rows
// as fp32, ks / vs floats apart. NCT = head_dim / 16 when fixed at compile time, 0 = any.
// KE / VE: the element types kt / vt point at: float (fp32 rows in place, or any cache's rows
// converted into scratch), or bf16 rows read in place (head_dim a multiple of 16), widened as
// they are loaded (loadv) instead of through a pass over scratch.
template <int NCT, typename KE, typename VE>
void attend_tile(int64_t R, int64_t G, int64_t nc, int64_t dp, const int64_t* row_lo, const int64_t* row_hi,
                 int64_t tile, int64_t n, const KE* kt, int64_t ks, const VE* vt, int64_t vs, const float* qf,
                 float* acc, float* m, float* l, float* sc, float* part, Ahead& ahead) {
    for (int64_t t = n; t < kLanes; ++t) store16(part + kSlot[t] * kLanes, v16{});

    // Scores, row by row: the row's q chunks stay in registers across the tile's keys.
    for (int64_t r = 0; r < R; ++r) {
        const float* qr = qf + r * dp;
        if constexpr (NCT > 0) {
            if (n == kLanes) {  // a whole tile (every tile of a decode but its last): keys unrolled at
                // compile time, so the 16 partial dot products stay in registers for the reduction
                // instead of going through `part` in memory.
                v16 qv[NCT], parts[kLanes];
                for (int c = 0; c < NCT; ++c) qv[c] = load16(qr + c * kLanes);
#pragma GCC unroll 16
                for (int t = 0; t < kLanes; ++t) {
                    ahead.step();
                    const KE* kr = kt + t * ks;
                    v16 p = qv[0] * loadv(kr);
                    for (int c = 1; c < NCT; ++c) p += qv[c] * loadv(kr + c * kLanes);
                    parts[kSlot[t]] = p;
                }
                store16(sc + r * kLanes, sum_lanes_16(parts));
                continue;
            }
            v16 qv[NCT];
            for (int c = 0; c < NCT; ++c) qv[c] = load16(qr + c * kLanes);
            for (int64_t t = 0; t < n; ++t) {
                ahead.step();
                const KE* kr = kt + t * ks;
                v16 p = qv[0] * loadv(kr);
                for (int c = 1; c < NCT; ++c) p += qv[c] * loadv(kr + c * kLanes);
                store16(part + kSlot[t] * kLanes, p);
            }
        } else {
            for (int64_t t = 0; t < n; ++t) {
                ahead.step();
                const KE* kr = kt + t * ks;
                v16 p = load16(qr) * loadv(kr);
                for (int64_t c = 1; c < nc; ++c) p += load16(qr + c * kLanes) * loadv(kr + c * kLanes);
                store16(part + kSlot[t] * kLanes, p);
            }
        }
        v16 parts[kLanes];
        for (int t = 0; t < kLanes; ++t) parts[t] = load16(part + t * kLanes);
        store16(sc + r * kLanes, sum_lanes_16(parts));
    }

    // Mask, then the online softmax update of each row. The accumulator's rescale by
    // alpha = exp(m_old - m_new) is left to P.V, which loads the accumulator anyway (alpha is
    // exactly 1 when the max did not move: fast_exp(0) == 1).
    float* alpha = sc + R * kLanes;  // [R], after the scores in scratch
    for (int64_t r = 0; r < R; ++r) {
        const int64_t j = r / G;
        const int64_t lo = row_lo[j] - tile, hi = std::min<int64_t>(row_hi[j] - tile, n);
        float* sr = sc + r * kLanes;
        float tile_max = kNegInf;
        if (lo <= 0 && hi >= kLanes) {  // every key of the tile visible (all but a decode's last tile)
#pragma omp simd reduction(max : tile_max)
            for (int64_t t = 0; t < kLanes; ++t) tile_max = std::max(tile_max, sr[t]);
        } else {
#pragma omp simd reduction(max : tile_max)
            for (int64_t t = 0; t < kLanes; ++t) {
                sr[t] = (t >= lo && t < hi) ? sr[t] : kNegInf;
                tile_max = std::max(tile_max, sr[t]);
            }
        }
        alpha[r] = 1.0f;
        if (tile_max == kNegInf) {
            std::fill(sr, sr + kLanes, 0.0f);
            continue;
        }
        const float m_new = std::max(m[r], tile_max);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < kLanes; ++t) {
            const float p = sr[t] == kNegInf ? 0.0f : fast_exp(sr[t] - m_new);
            sr[t] = p;
            sum += p;
        }
        alpha[r] = fast_exp(m[r] - m_new);
        l[r] = keep_rounded(l[r] * alpha[r]) + sum;
        m[r] = m_new;
        if constexpr (NCT == 0) {
            float* ar = acc + r * dp;
#pragma omp simd
            for (int64_t d = 0; d < dp; ++d) ar[d] *= alpha[r];
        }
    }

    int64_t r_first = 0;
    if constexpr (NCT > 0) {
        constexpr int kRows = NCT <= 4 ? 4 : 2;
        for (; r_first + kRows <= R; r_first += kRows) {
            const float* pr = sc + r_first * kLanes;
            float* ar = acc + r_first * dp;
            v16 av[kRows][NCT];
            for (int i = 0; i < kRows; ++i)
                for (int c = 0; c < NCT; ++c) av[i][c] = keep_rounded(load16(ar + i * dp + c * kLanes) * alpha[r_first + i]);
            for (int64_t t = 0; t < n; ++t) {
                const VE* vr = vt + t * vs;
                v16 vv[NCT];
                for (int c = 0; c < NCT; ++c) vv[c] = loadv(vr + c * kLanes);
                for (int i = 0; i < kRows; ++i) {
                    const float w = pr[i * kLanes + t];
                    for (int c = 0; c < NCT; ++c) av[i][c] += w * vv[c];
                }
            }
            for (int i = 0; i < kRows; ++i)
                for (int c = 0; c < NCT; ++c) store16(ar + i * dp + c * kLanes, av[i][c]);
        }
    }
    for (int64_t r = r_first; r < R; ++r) {
        const float* pr = sc + r * kLanes;
        float* ar = acc + r * dp;
        if constexpr (NCT > 0) {
            v16 av[NCT];
            for (int c = 0; c < NCT; ++c) av[c] = keep_rounded(load16(ar + c * kLanes) * alpha[r]);
            for (int64_t t = 0; t < n; ++t) {
                const VE* vr = vt + t * vs;
                for (int c = 0; c < NCT; ++c) av[c] += pr[t] * loadv(vr + c * kLanes);
            }
            for (int c = 0; c < NCT; ++c) store16(ar + c * kLanes, av[c]);
        } else {
            for (int64_t t = 0; t < n; ++t) {
                const VE* vr = vt + t * vs;
                for (int64_t c = 0; c < nc; ++c)
                    store16(ar + c * kLanes, load16(ar + c * kLanes) + pr[t] * loadv(vr + c * kLanes));
            }
        }
    }
}

// Ask for `bytes` bytes at p (whole 64-byte lines).
inline void prefetch_span(const char* p, int64_t bytes) {
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + byte);
}

// Token rows [t0, t1) of block `block_id`, kv heads [g0, g0 + ng) of each row, K and V.
template <typename KT>
inline Ahead rows_ahead(const Shape& sh, const KT* k_cache, const KT* v_cache, int64_t block_id, int64_t g0,
                        int64_t ng, int64_t t0, int64_t t1) {
    const int64_t esz = static_cast<int64_t>(sizeof(KT));
    const int64_t first = block_id * sh.block_stride + g0 * sh.head_stride + t0 * sh.token_stride;
    Ahead a;
    a.k = reinterpret_cast<const char*>(k_cache + first);
    a.v = reinterpret_cast<const char*>(v_cache + first);
    a.span = ((ng - 1) * sh.head_stride + sh.head_dim) * esz;
    a.stride = sh.token_stride * esz;
    a.runs = t1 - t0;
    if (a.stride == a.span) {  // the rows are one run of memory
        a.span *= a.runs;
        a.runs = t1 > t0 ? 1 : 0;
    }
    return a;
}

// How many blocks ahead of the one being computed an item asks for K/V (the block table says
// where every block lies; no hardware prefetcher can guess the next one). Into L2, not L1: a
// block of all kv heads is 2 x 16 KB in fp32, L1 is 32 KB.
constexpr int64_t kPrefetchBlocks = PS_PREFETCH_BLOCKS;

// One item: rows [row0, row0 + nrows) of sequence `seq`, every query head of kv heads
// [kv_head, kv_head + num_kv) over keys [key_lo, key_hi); block by block, each kv head's tiles
// of the block in turn, so an item over all kv heads reads each block's token rows whole.
// While block b is computed, block b + kPrefetchBlocks is asked for (a slice per kv head), and
// past the item's last block the first blocks of `next` (the item this thread does next).
template <typename QT, typename KT, int NCT>
void attend_item(const PsAttentionPlan& plan, const Shape& sh, const Item& it, const QT* q, const KT* k_cache,
                 const KT* v_cache, QT* out, float* partial_buf, const Item* next) {
    const int64_t dh = sh.head_dim;
    const int64_t nc = NCT > 0 ? NCT : (dh + kLanes - 1) / kLanes;
    const int64_t dp = nc * kLanes;  // head_dim padded to whole vectors
    const int64_t G = sh.group;
    const int64_t bs = plan.block_size;
    const int64_t NG = it.num_kv;
    const int64_t R = static_cast<int64_t>(it.nrows) * G;  // query vectors per kv head
    const int64_t per_head = R * (2 * dp + 2);               // qf, acc, m, l of one kv head
    float* state =
        tls_floats.get(static_cast<size_t>(NG * per_head + R * (kLanes + 1) + kLanes * kLanes + 2 * kLanes * dp));
    float* sc = state + NG * per_head;   // [R, 16] scores, then probabilities, of the current tile; [R] alpha
    float* part = sc + R * (kLanes + 1); // [16, 16] per-key partial dot products of one row
    float* kf = part + kLanes * kLanes;  // [16, dp] converted K rows of the tile
    float* vf = kf + kLanes * dp;        // [16, dp] converted V rows
    int64_t* row_lo = tls_ints.get(static_cast<size_t>(it.nrows) * 2);  // first key each row sees
    int64_t* row_hi = row_lo + it.nrows;                                   // one past its last
    // kv head g's slice of `state`: qf [R, dp], acc [R, dp], m [R] running max, l [R] running sum
    auto qf_of = [&](int64_t g) { return state + g * per_head; };
    auto acc_of = [&](int64_t g) { return state + g * per_head + R * dp; };
    auto m_of = [&](int64_t g) { return state + g * per_head + 2 * R * dp; };
    auto l_of = [&](int64_t g) { return state + g * per_head + 2 * R * dp + R; };

    const int s = it.seq;
    for (int32_t j = 0; j < it.nrows; ++j) {
        const int64_t pos = row_pos(plan, s, it.row0 + j);
        row_lo[j] = row_floor(plan, pos);
        row_hi[j] = pos + 1;
    }
    for (int64_t g = 0; g < NG; ++g) {
        float* qf = qf_of(g);
        for (int32_t j = 0; j < it.nrows; ++j) {
            const QT* qrow = q + (plan.q_start[s] + it.row0 + j) * sh.q_row_stride + (it.kv_head + g) * G * dh;
            for (int64_t h = 0; h < G; ++h) {
                float* dst = qf + (j * G + h) * dp;
                const QT* src = qrow + h * dh;
#pragma omp simd
                for (int64_t d = 0; d < dh; ++d) dst[d] = to_float(src[d]) * sh.scale;
                for (int64_t d = dh; d < dp; ++d) dst[d] = 0.0f;
            }
        }
        std::fill(acc_of(g), acc_of(g) + R * dp, 0.0f);
        std::fill(m_of(g), m_of(g) + R, kNegInf);
        std::fill(l_of(g), l_of(g) + R, 0.0f);
    }

    const int32_t* table = plan.block_table + s * plan.table_stride;
    const int64_t b_first = it.key_lo / bs, b_end = (it.key_hi + bs - 1) / bs;
    const int32_t* next_table = next != nullptr ? plan.block_table + next->seq * plan.table_stride : nullptr;
    const int64_t next_first = next != nullptr ? next->key_lo / bs : 0;
    const int64_t next_end = next != nullptr ? (next->key_hi + bs - 1) / bs : 0;
    // The start: the item's first blocks were not asked for by a previous item of this thread
    // (or were, and asking again costs little).
    for (int64_t b = b_first; b < std::min(b_end, b_first + kPrefetchBlocks); ++b)
        rows_ahead(sh, k_cache, v_cache, table[b], it.kv_head, NG, 0, bs).drain();
    for (int64_t b = b_first; b < b_end; ++b) {
        // The block to ask for while this one is computed: this item's, else the next item's.
        int64_t ahead_id = -1, ahead_g0 = 0, ahead_ng = 0;
        if (b + kPrefetchBlocks < b_end) {
            ahead_id = table[b + kPrefetchBlocks];
            ahead_g0 = it.kv_head;
            ahead_ng = NG;
        } else if (next != nullptr && next_first + (b + kPrefetchBlocks - b_end) < next_end) {
            ahead_id = next_table[next_first + (b + kPrefetchBlocks - b_end)];
            ahead_g0 = next->kv_head;
            ahead_ng = next->num_kv;
        }
        const int64_t block_end = std::min<int64_t>(it.key_hi, b * bs + bs);
        for (int64_t g = 0; g < NG; ++g) {
            // Rows [g, g + 1) * bs / NG of the block ahead: its ask spread over the kv heads' tiles.
            Ahead ahead;
            if (ahead_id >= 0)
                ahead = rows_ahead(sh, k_cache, v_cache, ahead_id, ahead_g0, ahead_ng, g * bs / NG, (g + 1) * bs / NG);
            const int64_t kvh = it.kv_head + g;
            const int64_t head = kvh * sh.head_stride;
            for (int64_t tile = std::max<int64_t>(it.key_lo, b * bs); tile < block_end; tile += kLanes) {
                const int64_t n = std::min<int64_t>(kLanes, block_end - tile);
                const int64_t first =
                    static_cast<int64_t>(table[b]) * sh.block_stride + (tile - b * bs) * sh.token_stride + head;
                int64_t ks, vs;
                // The tile's first slot, where its rows' per-token scales start.
                const int64_t slot = static_cast<int64_t>(table[b]) * bs + (tile - b * bs);
                const int64_t scale_at = slot * sh.scale_token_stride + kvh;
                const RowScales kscale{sh.k_scales ? sh.k_scales + scale_at : nullptr, sh.scale_token_stride,
                                       sh.k_scale};
                const RowScales vscale{sh.v_scales ? sh.v_scales + scale_at : nullptr, sh.scale_token_stride,
                                       sh.v_scale};
                bool done = false;
                if constexpr (std::is_same_v<KT, bf16> && NCT > 0) {
                    // Few query vectors (a decode): K converted once into scratch (the score loop
                    // reads it once per vector), V read in place, widened as loaded (P.V reads it
                    // once per four vectors). Measured 7% faster at 32 x 256 than both via scratch,
                    // and V in place too (K then widened once per vector) 10-20% slower.
                    if (R <= 8) {
                        const float* kt = tile_rows(k_cache + first, sh.token_stride, n, dh, dp, kf, ks, kscale);
                        attend_tile<NCT>(R, G, nc, dp, row_lo, row_hi, tile, n, kt, ks, v_cache + first,
                                         sh.token_stride, qf_of(g), acc_of(g), m_of(g), l_of(g), sc, part, ahead);
                        done = true;
                    }
                }
                if (!done) {
                    const float* kt = tile_rows(k_cache + first, sh.token_stride, n, dh, dp, kf, ks, kscale);
                    const float* vt = tile_rows(v_cache + first, sh.token_stride, n, dh, dp, vf, vs, vscale);
                    attend_tile<NCT>(R, G, nc, dp, row_lo, row_hi, tile, n, kt, ks, vt, vs, qf_of(g), acc_of(g),
                                     m_of(g), l_of(g), sc, part, ahead);
                }
            }
            ahead.drain();
        }
    }

    if (partial_buf != nullptr) {  // one kv head (make_items); layout: m[R], l[R], acc[R, dh]
        std::memcpy(partial_buf, m_of(0), R * sizeof(float));
        std::memcpy(partial_buf + R, l_of(0), R * sizeof(float));
        for (int64_t r = 0; r < R; ++r)
            std::memcpy(partial_buf + 2 * R + r * dh, acc_of(0) + r * dp, dh * sizeof(float));
        return;
    }
    for (int64_t g = 0; g < NG; ++g) {
        const float* l = l_of(g);
        for (int64_t r = 0; r < R; ++r) {
            const int64_t j = r / G, h = r % G;
            QT* orow = out + (plan.q_start[s] + it.row0 + j) * sh.out_row_stride + ((it.kv_head + g) * G + h) * dh;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            const float* ar = acc_of(g) + r * dp;
            for (int64_t d = 0; d < dh; ++d) store(orow + d, ar[d] * inv);
        }
    }
}

// Merge the partitions [first, first + count) of one (sequence, tile, kv head).
template <typename QT>
void merge_partials(const PsAttentionPlan& plan, const Shape& sh, const Item* items, int64_t count,
                    const float* partials, int64_t partial_stride, QT* out) {
    const Item& it = items[0];
    const int64_t dh = sh.head_dim, G = sh.group, R = static_cast<int64_t>(it.nrows) * G;
    std::vector<float> acc(dh);
    for (int64_t r = 0; r < R; ++r) {
        float m_max = kNegInf;
        for (int64_t i = 0; i < count; ++i) m_max = std::max(m_max, partials[items[i].partial * partial_stride + r]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float l_sum = 0.0f;
        for (int64_t i = 0; i < count; ++i) {
            const float* part = partials + items[i].partial * partial_stride;
            if (part[R + r] == 0.0f) continue;  // this partition saw no key of this row
            const float w = fast_exp(part[r] - m_max);
            l_sum += part[R + r] * w;
            const float* pa = part + 2 * R + r * dh;
            for (int64_t d = 0; d < dh; ++d) acc[d] += pa[d] * w;
        }
        const int64_t j = r / G, h = r % G;
        QT* orow = out + (plan.q_start[it.seq] + it.row0 + j) * sh.out_row_stride + (it.kv_head * G + h) * dh;
        const float inv = l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
        for (int64_t d = 0; d < dh; ++d) store(orow + d, acc[d] * inv);
    }
}

// Cut the plan into items. Each item takes all kv heads of its rows (whole token rows read,
// one stream per sequence; ~15% faster than one item per kv head at 32 x 256) when that leaves enough items for the threads; else one kv head
// each, and key ranges are split too when even those are too few.
int64_t make_items(const PsAttentionPlan& plan, const Shape& sh, int num_threads, std::vector<Item>& items) {
    const int64_t tile_rows = std::max<int64_t>(1, kMaxTileVectors / sh.group);
    int64_t row_tiles = 0, longest = 0;
    for (int64_t s = 0; s < plan.num_seqs; ++s) {
        row_tiles += (plan.q_len[s] + tile_rows - 1) / tile_rows;
        longest = std::max<int64_t>(longest, plan.ctx_len[s]);
    }
    const int64_t wanted = 4 * static_cast<int64_t>(num_threads);
    const bool whole_rows = num_threads == 1 || row_tiles >= wanted;
    const int64_t heads_per_item = whole_rows ? sh.num_kv_heads : 1;
    const int64_t base_items = row_tiles * (sh.num_kv_heads / heads_per_item);
    int64_t partition_keys = longest;  // no split
    if (num_threads > 1 && base_items < wanted) {
        const int64_t splits = (wanted + base_items - 1) / base_items;
        partition_keys = std::max(kMinPartitionKeys, (longest + splits - 1) / splits);
        partition_keys = (partition_keys + plan.block_size - 1) / plan.block_size * plan.block_size;
    }
    int64_t num_partials = 0;
    items.clear();
    for (int64_t s = 0; s < plan.num_seqs; ++s) {
        for (int64_t row0 = 0; row0 < plan.q_len[s]; row0 += tile_rows) {
            const int32_t nrows = static_cast<int32_t>(std::min<int64_t>(tile_rows, plan.q_len[s] - row0));
            const int64_t lo = row_floor(plan, row_pos(plan, s, row0));
            const int64_t hi = row_pos(plan, s, row0 + nrows - 1) + 1;
            const int64_t first_part = lo / partition_keys, last_part = (hi - 1) / partition_keys;
            const bool split = last_part > first_part;  // only with one kv head per item
            for (int32_t g = 0; g < sh.num_kv_heads; g += static_cast<int32_t>(heads_per_item)) {
                for (int64_t part = first_part; part <= last_part; ++part) {
                    Item it;
                    it.seq = static_cast<int32_t>(s);
                    it.row0 = static_cast<int32_t>(row0);
                    it.nrows = nrows;
                    it.kv_head = g;
                    it.num_kv = static_cast<int32_t>(heads_per_item);
                    it.key_lo = static_cast<int32_t>(std::max(lo, part * partition_keys));
                    it.key_hi = static_cast<int32_t>(std::min(hi, (part + 1) * partition_keys));
                    it.partial = split ? num_partials++ : -1;
                    it.cost = static_cast<int64_t>(it.key_hi - it.key_lo) * nrows * heads_per_item;
                    items.push_back(it);
                }
            }
        }
    }
    return num_partials;
}

template <typename QT, typename KT, int NCT>
void run_attention(const PsAttentionPlan& plan, const Shape& sh, const void* q, const void* k_cache,
                   const void* v_cache, void* out, int num_threads) {
    // A small step (one short decode) is done before a thread team could even be woken.
    int64_t work = 0;
    for (int64_t s = 0; s < plan.num_seqs; ++s) work += static_cast<int64_t>(plan.ctx_len[s]) * plan.q_len[s];
    if (work * sh.num_heads < kMinParallelWork) num_threads = 1;
    std::vector<Item> items;
    const int64_t num_partials = make_items(plan, sh, num_threads, items);
    const int64_t tile_vectors = std::max<int64_t>(1, kMaxTileVectors / sh.group) * sh.group;
    const int64_t partial_stride = tile_vectors * (sh.head_dim + 2);  // items with partials have one kv head
    std::vector<float> partials(static_cast<size_t>(num_partials * partial_stride));
    // Longest first, so the last items to start are short ones (the ordering a greedy
    // scheduler needs to balance uneven contexts); partitions of one group stay adjacent.
    std::vector<int64_t> order(items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
    if (num_threads > 1)
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
    const int64_t n = static_cast<int64_t>(items.size());
    const QT* qp = static_cast<const QT*>(q);
    const KT* kp = static_cast<const KT*>(k_cache);
    const KT* vp = static_cast<const KT*>(v_cache);
    QT* op = static_cast<QT*>(out);
    // Items are handed out one at a time (longest first), each thread claiming its next item
    // when it starts the current one, so it can ask for the next item's first blocks while it
    // finishes this one.
    std::atomic<int64_t> claimed{0};
    auto work_items = [&]() {
        int64_t cur = claimed.fetch_add(1, std::memory_order_relaxed);
        while (cur < n) {
            const int64_t nxt = claimed.fetch_add(1, std::memory_order_relaxed);
            const Item& it = items[order[cur]];
            attend_item<QT, KT, NCT>(plan, sh, it, qp, kp, vp, op,
                                    it.partial >= 0 ? partials.data() + it.partial * partial_stride : nullptr,
                                    nxt < n ? &items[order[nxt]] : nullptr);
            cur = nxt;
        }
    };
    if (num_threads > 1 && n > 1) {
#pragma omp parallel num_threads(num_threads)
        work_items();
    } else {
        work_items();
    }
    if (num_partials == 0) return;
    // Items of one (sequence, tile, kv head) are adjacent in `items`: merge each such run.
    std::vector<int64_t> runs;
    for (int64_t i = 0; i < n; ++i) {
        if (items[i].partial < 0) continue;
        const bool starts = i == 0 || items[i - 1].partial < 0 || items[i - 1].seq != items[i].seq ||
                            items[i - 1].row0 != items[i].row0 || items[i - 1].kv_head != items[i].kv_head;
        if (starts) runs.push_back(i);
    }
    const int64_t num_runs = static_cast<int64_t>(runs.size());
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_runs > 1)
    for (int64_t r = 0; r < num_runs; ++r) {
        int64_t end = runs[r] + 1;
        while (end < n && items[end].partial >= 0 && items[end].seq == items[runs[r]].seq &&
               items[end].row0 == items[runs[r]].row0 && items[end].kv_head == items[runs[r]].kv_head)
            ++end;
        merge_partials<QT>(plan, sh, items.data() + runs[r], end - runs[r], partials.data(), partial_stride, op);
    }
}

template <typename QT, typename KT>
int dispatch_head_dim(const PsAttentionPlan& plan, const Shape& sh, const void* q, const void* k_cache,
                      const void* v_cache, void* out, int num_threads) {
    switch (sh.head_dim) {
        case 64: run_attention<QT, KT, 4>(plan, sh, q, k_cache, v_cache, out, num_threads); break;
        case 128: run_attention<QT, KT, 8>(plan, sh, q, k_cache, v_cache, out, num_threads); break;
        default: run_attention<QT, KT, 0>(plan, sh, q, k_cache, v_cache, out, num_threads); break;
    }
    return 0;
}

// ---- Fresh causal prefill chunks (start 0, no window): tiled, scores as register GEMMs ----
//
// A fresh chunk attends causally over its own K/V, read from the step's k / v rows (no block
// table). One work item is (chunk, kv head, a range of q tiles). A q tile is kFreshLanes query
// vectors, kept transposed and pre-scaled (qt[d][lane]): BQ = 32 / G tokens x the G heads of
// the kv head's group, token-major (lane = token * G + head), so every query head of the group
// shares each K/V row. For a tile of kFreshKeys keys, the scores come out transposed,
// s[key][lane]: each K value broadcast against two lane vectors, 8 keys x 2 vectors of
// accumulators in registers (a GEMM micro-kernel), so the softmax's max and sum run lane-wise
// across keys with no horizontal reduction. P.V: o[lane][d] += p[key][lane] v[key][d], 4 lanes
// x 4 vectors of d in registers per pass over the tile's keys; the rescale by
// alpha = exp(m_old - m_new) is folded into loading o. Only tiles that reach past the q tile's
// first token are masked; tiles past its last token are never computed. The item's K/V rows are
// first widened to fp32 rows of `dp` floats (zero-padded to whole tiles and vectors), once per
// item: any head_dim, any storage type, each row read once from the strided qkv output.
constexpr int kFreshLanes = 32;
constexpr int kFreshKeys = 16;

struct FreshItem {
    int32_t chunk, kv_head, tile_lo, tile_hi;  // q tiles [tile_lo, tile_hi) of BQ tokens
    int64_t cost;
};

struct FreshShape {
    int64_t num_heads, num_kv_heads, head_dim, group, dp, bq;
    int64_t q_stride, k_stride, v_stride, out_stride;  // row strides (elements)
    float scale;
};

thread_local Scratch<float> tls_fresh;

inline float* align64(float* p) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// s[i][0..31] = sum_d ks[i][d] * qt[d][0..31] for 8 key rows (dp floats apart), d < D.
template <int DC>
inline void fresh_scores_8(const float* ks, int64_t dp, int64_t dh, const float* qt, float* s) {
    v16 a0[8], a1[8];
    for (int i = 0; i < 8; ++i) a0[i] = a1[i] = v16{};
    const int64_t n = DC > 0 ? DC : dh;
#pragma GCC unroll 4
    for (int64_t d = 0; d < n; ++d) {
        const v16 b0 = load16(qt + d * kFreshLanes), b1 = load16(qt + d * kFreshLanes + kLanes);
        for (int i = 0; i < 8; ++i) {
            const float x = ks[i * dp + d];
            a0[i] += x * b0;
            a1[i] += x * b1;
        }
    }
    for (int i = 0; i < 8; ++i) {
        store16(s + i * kFreshLanes, a0[i]);
        store16(s + i * kFreshLanes + kLanes, a1[i]);
    }
}

// o[lane0 + i][c0 * 16 ...] = o * alpha[lane] + sum_j p[j][lane] * vs[j][...], 4 lanes x NB vectors.
template <int NB>
inline void fresh_pv(float* o, int64_t dp, const float* alpha, const float* p, const float* vs, int64_t nkeys,
                     int64_t lane0, int64_t c0) {
    v16 acc[4][NB];
    for (int i = 0; i < 4; ++i) {
        const float a = alpha[lane0 + i];
        for (int c = 0; c < NB; ++c) acc[i][c] = load16(o + (lane0 + i) * dp + (c0 + c) * kLanes) * a;
    }
    for (int64_t j = 0; j < nkeys; ++j) {
        v16 vv[NB];
        for (int c = 0; c < NB; ++c) vv[c] = load16(vs + j * dp + (c0 + c) * kLanes);
        for (int i = 0; i < 4; ++i) {
            const float x = p[j * kFreshLanes + lane0 + i];
            for (int c = 0; c < NB; ++c) acc[i][c] += x * vv[c];
        }
    }
    for (int i = 0; i < 4; ++i)
        for (int c = 0; c < NB; ++c) store16(o + (lane0 + i) * dp + (c0 + c) * kLanes, acc[i][c]);
}

// r[0..15] (rows) := their transpose, in registers: four butterfly stages, each swapping the
// off-diagonal h x h blocks of every 2h x 2h block (64 two-source shuffles in all).
inline void transpose_16x16(v16* r) {
    for (int i = 0; i < 16; i += 16)
        for (int j = 0; j < 8; ++j) {
            const v16 a = r[i + j], c = r[i + j + 8];
            r[i + j] = PS_SHUFFLE(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
            r[i + j + 8] = PS_SHUFFLE(a, c, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            const v16 a = r[i + j], c = r[i + j + 4];
            r[i + j] = PS_SHUFFLE(a, c, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
            r[i + j + 4] = PS_SHUFFLE(a, c, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
        }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; ++j) {
            const v16 a = r[i + j], c = r[i + j + 2];
            r[i + j] = PS_SHUFFLE(a, c, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
            r[i + j + 2] = PS_SHUFFLE(a, c, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
        }
    for (int i = 0; i < 16; i += 2) {
        const v16 a = r[i], c = r[i + 1];
        r[i] = PS_SHUFFLE(a, c, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        r[i + 1] = PS_SHUFFLE(a, c, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
}

// qt[d][lane] = q of lane (token q0 + lane / G, head g * G + lane % G) at d, times scale; dead
// lanes (lane >= lanes) 0. fp32 / bf16 rows of whole vectors go through 16 x 16 transposes in
// registers (a scalar scatter of q was a fifth of the kernel's time at 128 tokens).
template <typename T>
inline void fresh_load_q(const T* q0row, int64_t q_stride, int64_t G, int64_t head0, int64_t dh, int64_t lanes,
                         float scale, float* qt) {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
        if (dh % kLanes == 0) {
            for (int64_t lb = 0; lb < kFreshLanes; lb += kLanes) {
                for (int64_t d0 = 0; d0 < dh; d0 += kLanes) {
                    v16 r[kLanes];
                    for (int64_t i = 0; i < kLanes; ++i) {
                        const int64_t lane = lb + i;
                        r[i] = lane < lanes ? loadv(q0row + (lane / G) * q_stride + (head0 + lane % G) * dh + d0) * scale
                                            : v16{};
                    }
                    transpose_16x16(r);
                    for (int64_t i = 0; i < kLanes; ++i) store16(qt + (d0 + i) * kFreshLanes + lb, r[i]);
                }
            }
            return;
        }
    }
    for (int64_t lane = 0; lane < kFreshLanes; ++lane) {
        const bool live = lane < lanes;
        const T* qr = q0row + (live ? lane / G : 0) * q_stride + (head0 + (live ? lane % G : 0)) * dh;
        for (int64_t d = 0; d < dh; ++d) qt[d * kFreshLanes + lane] = live ? to_float(qr[d]) * scale : 0.0f;
    }
}

// Where a chunk's key rows come from. StepRows: a fresh chunk's own rows of the step's k / v
// (key j = the chunk's row j). PoolRows: the paged pool through the chunk's block table, as
// the plan kernel reads it (key j = position j; the step's own K/V are already written there).
template <typename T>
struct StepRows {
    const T *k, *v;
    int64_t k_stride, v_stride, dh;
    const int32_t* q_start;
    int64_t start(int64_t) const { return 0; }
    void row(int64_t c, int64_t g, int64_t j, const T*& kr, const T*& vr) const {
        kr = k + (q_start[c] + j) * k_stride + g * dh;
        vr = v + (q_start[c] + j) * v_stride + g * dh;
    }
};

template <typename T>
struct PoolRows {
    const T *k, *v;
    const PsAttentionPlan* plan;
    int64_t block_stride, head_stride, token_stride;
    int64_t start(int64_t c) const { return plan->ctx_len[c] - plan->q_len[c]; }
    void row(int64_t c, int64_t g, int64_t j, const T*& kr, const T*& vr) const {
        const int64_t bs = plan->block_size;
        const int64_t off = static_cast<int64_t>(plan->block_table[c * plan->table_stride + j / bs]) * block_stride +
                            (j % bs) * token_stride + g * head_stride;
        kr = k + off;
        vr = v + off;
    }
};

// One item of a chunk whose first query is at position `start` (0 for a fresh chunk): query
// start + t sees keys [0, start + t]; only key tiles reaching past a q tile's first position are
// masked, so the cached keys before the chunk cost no mask.
template <typename T, int DC, typename Rows>
void fresh_item(const FreshShape& sh, const FreshItem& it, const int32_t* q_start, const int32_t* q_len,
                const T* q, const Rows& rows, T* out) {
    const int64_t dh = DC > 0 ? DC : sh.head_dim, dp = DC > 0 ? DC : sh.dp, G = sh.group, bq = sh.bq;
    const int64_t first = q_start[it.chunk], len = q_len[it.chunk], g = it.kv_head;
    const int64_t start = rows.start(it.chunk);
    const int64_t nkeys = start + std::min<int64_t>(len, static_cast<int64_t>(it.tile_hi) * bq);  // keys any row sees
    const int64_t kpad = (nkeys + kFreshKeys - 1) / kFreshKeys * kFreshKeys;
    const int64_t nvec = dp / kLanes;
    float* base = align64(tls_fresh.get(static_cast<size_t>(2 * kpad * dp + dh * kFreshLanes + kFreshLanes * dp +
                                                            kFreshKeys * kFreshLanes + 4 * kFreshLanes + 64)));
    float* ks = base;                          // [kpad][dp]
    float* vs = ks + kpad * dp;                // [kpad][dp]
    float* qt = vs + kpad * dp;                // [dh][32]
    float* o = qt + dh * kFreshLanes;          // [32][dp]
    float* s = o + kFreshLanes * dp;           // [16][32] scores, then probabilities
    float* m = s + kFreshKeys * kFreshLanes;   // [32] running max
    float* l = m + kFreshLanes;                // [32] running sum
    float* alpha = l + kFreshLanes;            // [32]
    float* tok = alpha + kFreshLanes;          // [32] each lane's token (as float, for the mask)
    for (int64_t j = 0; j < kpad; ++j) {
        float* kd = ks + j * dp;
        float* vd = vs + j * dp;
        if (j < nkeys) {
            const T *kr, *vr;
            rows.row(it.chunk, g, j, kr, vr);
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) kd[d] = to_float(kr[d]);
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) vd[d] = to_float(vr[d]);
            for (int64_t d = dh; d < dp; ++d) kd[d] = vd[d] = 0.0f;
        } else {
            std::fill(kd, kd + dp, 0.0f);  // never seen: masked (past every row's token)
            std::fill(vd, vd + dp, 0.0f);
        }
    }
    for (int64_t tile = it.tile_lo; tile < it.tile_hi; ++tile) {
        const int64_t q0 = tile * bq, ntok = std::min<int64_t>(bq, len - q0), lanes = ntok * G;
        fresh_load_q(q + (first + q0) * sh.q_stride, sh.q_stride, G, g * G, dh, lanes, sh.scale, qt);
        for (int64_t lane = 0; lane < kFreshLanes; ++lane) {
            tok[lane] = static_cast<float>(start + q0 + (lane < lanes ? lane / G : 0));
            m[lane] = kNegInf;
            l[lane] = 0.0f;
        }
        std::fill(o, o + kFreshLanes * dp, 0.0f);
        const int64_t lane_blocks = (lanes + 3) / 4;
        const int64_t last_tok = start + q0 + ntok - 1;  // positions
        const int64_t num_key_tiles = last_tok / kFreshKeys + 1;
        for (int64_t kt = 0; kt < num_key_tiles; ++kt) {
            const int64_t k0 = kt * kFreshKeys;
            fresh_scores_8<DC>(ks + k0 * dp, dp, dh, qt, s);
            fresh_scores_8<DC>(ks + (k0 + 8) * dp, dp, dh, qt, s + 8 * kFreshLanes);
            const bool diagonal = k0 + kFreshKeys - 1 > start + q0;
            if (diagonal) {  // key k0 + j is hidden from lanes whose token is before it
                for (int64_t j = 0; j < kFreshKeys; ++j) {
                    const float key = static_cast<float>(k0 + j);
                    float* sj = s + j * kFreshLanes;
#pragma omp simd
                    for (int64_t lane = 0; lane < kFreshLanes; ++lane) sj[lane] = key > tok[lane] ? kNegInf : sj[lane];
                }
            }
            float mx[kFreshLanes];
#pragma omp simd
            for (int64_t lane = 0; lane < kFreshLanes; ++lane) mx[lane] = m[lane];
            for (int64_t j = 0; j < kFreshKeys; ++j) {
                const float* sj = s + j * kFreshLanes;
#pragma omp simd
                for (int64_t lane = 0; lane < kFreshLanes; ++lane) mx[lane] = std::max(mx[lane], sj[lane]);
            }
            // Every lane sees key 0 in the first tile, so mx is finite from then on.
            float sum[kFreshLanes];
#pragma omp simd
            for (int64_t lane = 0; lane < kFreshLanes; ++lane) {
                alpha[lane] = fast_exp(m[lane] - mx[lane]);  // m = -inf at first: ~1e-38 x (l = 0, o = 0)
                sum[lane] = 0.0f;
            }
            for (int64_t j = 0; j < kFreshKeys; ++j) {
                float* sj = s + j * kFreshLanes;
#pragma omp simd
                for (int64_t lane = 0; lane < kFreshLanes; ++lane) {
                    const float p = sj[lane] == kNegInf ? 0.0f : fast_exp(sj[lane] - mx[lane]);
                    sj[lane] = p;
                    sum[lane] += p;
                }
            }
#pragma omp simd
            for (int64_t lane = 0; lane < kFreshLanes; ++lane) {
                l[lane] = keep_rounded(l[lane] * alpha[lane]) + sum[lane];
                m[lane] = mx[lane];
            }
            const float* vt = vs + k0 * dp;
            for (int64_t b = 0; b < lane_blocks; ++b) {
                int64_t c0 = 0;
                for (; c0 + 4 <= nvec; c0 += 4) fresh_pv<4>(o, dp, alpha, s, vt, kFreshKeys, 4 * b, c0);
                switch (nvec - c0) {
                    case 3: fresh_pv<3>(o, dp, alpha, s, vt, kFreshKeys, 4 * b, c0); break;
                    case 2: fresh_pv<2>(o, dp, alpha, s, vt, kFreshKeys, 4 * b, c0); break;
                    case 1: fresh_pv<1>(o, dp, alpha, s, vt, kFreshKeys, 4 * b, c0); break;
                    default: break;
                }
            }
        }
        for (int64_t lane = 0; lane < lanes; ++lane) {
            const int64_t t = q0 + lane / G, h = lane % G;
            T* orow = out + (first + t) * sh.out_stride + (g * G + h) * dh;
            const float inv = 1.0f / l[lane];
            const float* ol = o + lane * dp;
            for (int64_t d = 0; d < dh; ++d) store(orow + d, ol[d] * inv);
        }
    }
}

template <typename T, int DC, typename Rows>
void run_fresh(const FreshShape& sh, int64_t num_chunks, const int32_t* q_start, const int32_t* q_len,
               const void* q, const Rows& rows, void* out, int num_threads) {
    // Items: (chunk, kv head) with all its q tiles, or, when that leaves too few for the threads,
    // its q tiles cut into ranges of about equal cost (tile t costs ~start / BQ + t + 1 BQ-key units).
    int64_t work = 0;
    for (int64_t c = 0; c < num_chunks; ++c) work += static_cast<int64_t>(q_len[c]) * (rows.start(c) + q_len[c] / 2);
    if (work * sh.num_heads < kMinParallelWork) num_threads = 1;
    const int64_t wanted = num_threads > 1 ? 4 * static_cast<int64_t>(num_threads) : 1;
    const int64_t base = num_chunks * sh.num_kv_heads;
    const int64_t splits = base >= wanted ? 1 : (wanted + base - 1) / base;
    std::vector<FreshItem> items;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t tiles = (q_len[c] + sh.bq - 1) / sh.bq;
        const int64_t s0 = rows.start(c) / sh.bq;  // tile t weighs s0 + t + 1
        const int64_t total = tiles * s0 + tiles * (tiles + 1) / 2;
        const int64_t parts = std::min(splits, tiles);
        for (int32_t g = 0; g < sh.num_kv_heads; ++g) {
            int64_t lo = 0, acc = 0;
            for (int64_t part = 1; part <= parts && lo < tiles; ++part) {
                int64_t hi = lo;
                const int64_t target = total * part / parts;
                while (hi < tiles && (acc + s0 + hi + 1 <= target || hi == lo)) acc += s0 + ++hi;
                if (part == parts) {
                    while (hi < tiles) acc += s0 + ++hi;
                }
                const int64_t cost = (hi - lo) * s0 + (hi * (hi + 1) - lo * (lo + 1)) / 2;
                items.push_back({static_cast<int32_t>(c), g, static_cast<int32_t>(lo), static_cast<int32_t>(hi), cost});
                lo = hi;
            }
        }
    }
    if (num_threads > 1)
        std::stable_sort(items.begin(), items.end(), [](const FreshItem& a, const FreshItem& b) { return a.cost > b.cost; });
    const int64_t n = static_cast<int64_t>(items.size());
    const T* qp = static_cast<const T*>(q);
    T* op = static_cast<T*>(out);
    std::atomic<int64_t> claimed{0};
    auto work_items = [&]() {
        for (int64_t i = claimed.fetch_add(1, std::memory_order_relaxed); i < n;
             i = claimed.fetch_add(1, std::memory_order_relaxed))
            fresh_item<T, DC>(sh, items[i], q_start, q_len, qp, rows, op);
    };
    if (num_threads > 1 && n > 1) {
#pragma omp parallel num_threads(num_threads)
        work_items();
    } else {
        work_items();
    }
}

template <typename T, typename Rows>
void dispatch_fresh(const FreshShape& sh, int64_t num_chunks, const int32_t* q_start, const int32_t* q_len,
                    const void* q, const Rows& rows, void* out, int num_threads) {
    switch (sh.head_dim) {
        case 64: run_fresh<T, 64>(sh, num_chunks, q_start, q_len, q, rows, out, num_threads); break;
        case 128: run_fresh<T, 128>(sh, num_chunks, q_start, q_len, q, rows, out, num_threads); break;
        default: run_fresh<T, 0>(sh, num_chunks, q_start, q_len, q, rows, out, num_threads); break;
    }
}

// The tiled paths' shape, into sh: -1 for a bad one (no kv head, a group over one tile's lanes).
inline int fresh_shape(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, int64_t out_stride, float scale, FreshShape& sh) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0) return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (group > kFreshLanes) return -1;
    sh = {num_heads, num_kv_heads, head_dim, group, (head_dim + kLanes - 1) / kLanes * kLanes, kFreshLanes / group,
          q_stride, k_stride, v_stride, out_stride, scale};
    return 0;
}

// run(tag), tag a null T* of the storage type: 0, or -2 for a type this build lacks.
template <typename Run>
int by_storage_type(int dtype, Run run) {
    switch (dtype) {
        case kFloat32: run(static_cast<float*>(nullptr)); return 0;
        case kBFloat16: run(static_cast<bf16*>(nullptr)); return 0;
#ifdef __FLT16_MAX__
        case kFloat16: run(static_cast<f16*>(nullptr)); return 0;
#endif
        default: return -2;
    }
}

}  // namespace

extern "C" {

int ps_abi_version() { return kAbiVersion; }

int ps_dtype_supported(int dtype) {
    if (dtype == kFp8E4M3 || dtype == kFp8E5M2 || dtype == kInt8) return 1;  // caches read with fp32 q
#ifdef __FLT16_MAX__
    return dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16;
#else
    return dtype == kFloat32 || dtype == kBFloat16;
#endif
}

// out[rows of the plan] = softmax(q k^T * scale) v over each sequence's blocks.
// q, out and a plain cache share one dtype; a quantized cache (fp8 / int8) is read with fp32 q
// and out, its values times k_scales / v_scales (per slot and kv head, `scale_token_stride`
// floats between slots; nullptr = none) or else times k_scale / v_scale. Returns 0, or -1 for
// a bad shape, -2 for an unsupported or mixed dtype.
int ps_paged_attention(const PsAttentionPlan* plan, const void* q, int64_t q_row_stride, int q_dtype,
                       const void* k_cache, const void* v_cache, int64_t block_stride, int64_t head_stride,
                       int64_t token_stride, int kv_dtype, void* out, int64_t out_row_stride, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, float scale, const float* k_scales,
                       const float* v_scales, int64_t scale_token_stride, float k_scale, float v_scale,
                       int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || plan->block_size <= 0) return -1;
    if ((k_scales == nullptr) != (v_scales == nullptr)) return -1;
    if (plan->num_seqs == 0) return 0;
    Shape sh{num_heads, num_kv_heads, head_dim, num_heads / num_kv_heads, q_row_stride, out_row_stride,
             block_stride, head_stride, token_stride, scale};
    sh.k_scales = k_scales;
    sh.v_scales = v_scales;
    sh.scale_token_stride = scale_token_stride;
    sh.k_scale = k_scale;
    sh.v_scale = v_scale;
    num_threads = std::max(1, num_threads);
    switch (kv_dtype) {  // quantized caches: fp32 q only, one instantiation each
        case kFp8E4M3:
            return q_dtype == kFloat32 ? dispatch_head_dim<float, fp8_e4m3>(*plan, sh, q, k_cache, v_cache, out,
                                                                             num_threads) : -2;
        case kFp8E5M2:
            return q_dtype == kFloat32 ? dispatch_head_dim<float, fp8_e5m2>(*plan, sh, q, k_cache, v_cache, out,
                                                                             num_threads) : -2;
        case kInt8:
            return q_dtype == kFloat32 ? dispatch_head_dim<float, int8_t>(*plan, sh, q, k_cache, v_cache, out,
                                                                           num_threads) : -2;
        default: break;
    }
    // q, out and a plain cache share one dtype (the model's): one instantiation per dtype keeps
    // the first-use compile short.
    if (q_dtype != kv_dtype) return -2;
    switch (kv_dtype) {
        case kFloat32: return dispatch_head_dim<float, float>(*plan, sh, q, k_cache, v_cache, out, num_threads);
        case kBFloat16: return dispatch_head_dim<bf16, bf16>(*plan, sh, q, k_cache, v_cache, out, num_threads);
#ifdef __FLT16_MAX__
        case kFloat16: return dispatch_head_dim<f16, f16>(*plan, sh, q, k_cache, v_cache, out, num_threads);
#endif
        default: return -2;
    }
}

// k_cache[slot_mapping[t]] = k[t] (and v alike) for t < num_tokens: token rows of row_bytes,
// slot_stride_bytes apart in the cache; sources may have a row stride (v is a view into the
// fused qkv output). A negative slot skips the token (padding). Slots are not bounds-checked
// here: cpu_backend checks each step's slots and block tables against the pool first.
void ps_write_kv(const void* k, int64_t k_row_stride_bytes, const void* v, int64_t v_row_stride_bytes,
                 void* k_cache, void* v_cache, int64_t slot_stride_bytes, const int64_t* slot_mapping,
                 int64_t num_tokens, int64_t row_bytes, int num_threads) {
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
    char* kd = static_cast<char*>(k_cache);
    char* vd = static_cast<char*>(v_cache);
    // Threads only pay for themselves on prefill-sized writes.
    const bool parallel = num_threads > 1 && num_tokens * row_bytes >= (1 << 20);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        std::memcpy(kd + slot * slot_stride_bytes, ks + t * k_row_stride_bytes, row_bytes);
        std::memcpy(vd + slot * slot_stride_bytes, vs + t * v_row_stride_bytes, row_bytes);
    }
}

// One layer of a step in one call: write the step's K/V at their slots, then attend the plan's
// rows. The cache's token rows must be whole (head_stride == head_dim); strides are in elements.
int ps_attention_layer(const PsAttentionPlan* plan, const int64_t* slot_mapping, int64_t num_tokens,
                       const void* k, int64_t k_row_stride, const void* v, int64_t v_row_stride, const void* q,
                       int64_t q_row_stride, void* out, int64_t out_row_stride, void* k_cache, void* v_cache,
                       int64_t block_stride, int64_t head_stride, int64_t token_stride, int dtype, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, float scale, int num_threads) {
    if (head_stride != head_dim) return -1;
    // Plain caches only: a quantized cache is written (quantized) by the caller, then read
    // through ps_paged_attention.
    if (!ps_dtype_supported(dtype) || dtype > kFloat16) return -2;
    const int64_t size = dtype == kFloat32 ? 4 : 2;
    ps_write_kv(k, k_row_stride * size, v, v_row_stride * size, k_cache, v_cache, token_stride * size, slot_mapping,
                num_tokens, num_kv_heads * head_dim * size, num_threads);
    return ps_paged_attention(plan, q, q_row_stride, dtype, k_cache, v_cache, block_stride, head_stride, token_stride,
                              dtype, out, out_row_stride, num_heads, num_kv_heads, head_dim, scale, nullptr, nullptr,
                              0, 1.0f, 1.0f, num_threads);
}

// Fresh causal prefill chunks (start 0, no window) over their own K/V: chunk c is rows
// [q_start[c], q_start[c] + q_len[c]) of q, k, v and out (row strides in elements; each
// token's heads contiguous), row j attending keys [0, j]. q, k, v and out share one dtype.
// Returns 0, -1 for a bad shape (num_heads / num_kv_heads over 32), -2 for an unsupported dtype.
int ps_fresh_prefill(int64_t num_chunks, const int32_t* q_start, const int32_t* q_len, const void* q,
                     int64_t q_row_stride, const void* k, int64_t k_row_stride, const void* v, int64_t v_row_stride,
                     void* out, int64_t out_row_stride, int dtype, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int num_threads) {
    FreshShape sh;
    if (fresh_shape(num_heads, num_kv_heads, head_dim, q_row_stride, k_row_stride, v_row_stride, out_row_stride, scale,
                    sh) != 0)
        return -1;
    if (num_chunks == 0) return 0;
    return by_storage_type(dtype, [&](auto tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        const StepRows<T> rows{static_cast<const T*>(k), static_cast<const T*>(v), k_row_stride, v_row_stride, head_dim,
                               q_start};
        dispatch_fresh<T>(sh, num_chunks, q_start, q_len, q, rows, out, std::max(1, num_threads));
    });
}

// Causal prefill chunks after cached keys, tiled as ps_fresh_prefill's: chunk s of the plan is
// rows [q_start[s], q_start[s] + q_len[s]) of q and out, its queries at positions
// ctx_len[s] - q_len[s] + j, each attending keys [0, its position] read from the pool through
// the chunk's block table (the plan's layout and strides, as ps_paged_attention reads them; the
// chunk's own K/V must already be written there). Plain caches only (q, cache and out share one
// dtype), no sliding window. Returns 0, -1 for a bad shape (num_heads / num_kv_heads over 32,
// a window), -2 for an unsupported dtype.
int ps_cached_prefill(const PsAttentionPlan* plan, const void* q, int64_t q_row_stride, const void* k_cache,
                      const void* v_cache, int64_t block_stride, int64_t head_stride, int64_t token_stride, void* out,
                      int64_t out_row_stride, int dtype, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      float scale, int num_threads) {
    FreshShape sh;
    if (fresh_shape(num_heads, num_kv_heads, head_dim, q_row_stride, 0, 0, out_row_stride, scale, sh) != 0) return -1;
    if (plan->block_size <= 0 || plan->sliding_window != 0) return -1;
    if (plan->num_seqs == 0) return 0;
    return by_storage_type(dtype, [&](auto tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        const PoolRows<T> rows{static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), plan, block_stride,
                               head_stride, token_stride};
        dispatch_fresh<T>(sh, plan->num_seqs, plan->q_start, plan->q_len, q, rows, out, std::max(1, num_threads));
    });
}

}  // extern "C"
