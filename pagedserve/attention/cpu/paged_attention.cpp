// Paged attention for CPU tensors, reading K/V where they lie in the block pool.
//
// Plain C++17 with a C ABI (no torch headers): pagedserve/attention/cpu_kernel.py compiles it
// at first use with the system compiler (-O3 -march=native -fopenmp) and calls it through
// ctypes with raw data pointers. Under torch the OpenMP runtime it links is torch's own
// libgomp (same SONAME, already loaded), so its threads are torch's threads.
//
// Layout (one layer): k_cache, v_cache are [num_slots, num_kv_heads, head_dim] with
// slot = block_id * block_size + offset; q and out are [tokens, num_heads, head_dim] with heads
// contiguous and a row stride per token. Query heads h use kv head h / (num_heads / num_kv_heads).
//
// Work: a "sequence" of the plan is q_len query rows (a decode is 1 row, a prefill chunk many)
// whose last row sees ctx_len keys. Row j sits at position ctx_len - q_len + j and attends to
// keys in [max(0, pos - window + 1), pos] (window 0 = unlimited). One work item is one kv head
// of a tile of rows of one sequence over a range of key blocks: every query head of the GQA group
// shares each K/V row it loads. Softmax is online (running max m, sum l, accumulator acc), all
// in fp32 whatever the storage type. When there are too few items for the threads (one long
// decode), a sequence's key blocks are split into partitions whose (m, l, acc) are merged after.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

namespace {

constexpr int kAbiVersion = 1;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

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
    int64_t q_row_stride, out_row_stride, kv_token_stride;
    float scale;
};

struct Item {
    int32_t seq, row0, nrows, kv_head;
    int32_t key_lo, key_hi;  // key positions this item covers
    int64_t partial;         // index of its partial result, -1 = writes out directly
    int64_t cost;
};

constexpr int kMaxTileVectors = 64;      // query vectors (rows x group heads) per item
constexpr int64_t kMinPartitionKeys = 256;

inline int64_t row_pos(const PsAttentionPlan& p, int s, int j) { return p.ctx_len[s] - p.q_len[s] + j; }
inline int64_t row_floor(const PsAttentionPlan& p, int64_t pos) {
    return p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
}

// Thread-local scratch: the query vectors, accumulators and one block of scores.
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

template <typename QT, typename KT, int DH>
void attend_item(const PsAttentionPlan& plan, const Shape& sh, const Item& it, const QT* q, const KT* k_cache,
                 const KT* v_cache, QT* out, float* partial_buf) {
    const int64_t dh = DH > 0 ? DH : sh.head_dim;
    const int64_t G = sh.group;
    const int64_t bs = plan.block_size;
    const int64_t R = static_cast<int64_t>(it.nrows) * G;
    float* base = tls_floats.get(static_cast<size_t>(R * dh * 2 + dh * 2 + R * (bs + 2)));
    float* qf = base;
    float* acc = qf + R * dh;
    float* kf = acc + R * dh;
    float* vf = kf + dh;
    float* m = vf + dh;
    float* l = m + R;
    float* sc = l + R;  // [R, bs]
    int64_t* row_lo = tls_ints.get(static_cast<size_t>(it.nrows) * 2);  // first key each row sees
    int64_t* row_hi = row_lo + it.nrows;                                   // one past its last

    const int s = it.seq;
    for (int32_t j = 0; j < it.nrows; ++j) {
        const int64_t pos = row_pos(plan, s, it.row0 + j);
        row_lo[j] = row_floor(plan, pos);
        row_hi[j] = pos + 1;
        const QT* qrow = q + (plan.q_start[s] + it.row0 + j) * sh.q_row_stride + it.kv_head * G * dh;
        for (int64_t h = 0; h < G; ++h) {
            float* dst = qf + (j * G + h) * dh;
            const QT* src = qrow + h * dh;
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) dst[d] = to_float(src[d]) * sh.scale;
        }
    }
    std::fill(acc, acc + R * dh, 0.0f);
    std::fill(m, m + R, kNegInf);
    std::fill(l, l + R, 0.0f);

    const int32_t* table = plan.block_table + s * plan.table_stride;
    const int64_t head_off = it.kv_head * dh;
    for (int64_t b = it.key_lo / bs; b * bs < it.key_hi; ++b) {
        const int64_t t_begin = std::max<int64_t>(it.key_lo, b * bs);
        const int64_t t_end = std::min<int64_t>(it.key_hi, b * bs + bs);
        const int64_t n = t_end - t_begin;
        const int64_t first_slot = static_cast<int64_t>(table[b]) * bs + (t_begin - b * bs);
        const KT* kb = k_cache + first_slot * sh.kv_token_stride + head_off;
        const KT* vb = v_cache + first_slot * sh.kv_token_stride + head_off;

        for (int64_t t = 0; t < n; ++t) {
            const KT* krow = kb + t * sh.kv_token_stride;
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) kf[d] = to_float(krow[d]);
            const int64_t key_pos = t_begin + t;
            for (int64_t r = 0; r < R; ++r) {
                const int64_t j = r / G;
                float dot = 0.0f;
                const float* qr = qf + r * dh;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dh; ++d) dot += qr[d] * kf[d];
                const bool visible = key_pos >= row_lo[j] && key_pos < row_hi[j];
                sc[r * bs + t] = visible ? dot : kNegInf;
            }
        }
        for (int64_t r = 0; r < R; ++r) {
            float* sr = sc + r * bs;
            float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
            for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sr[t]);
            if (block_max == kNegInf) {
                std::fill(sr, sr + n, 0.0f);
                continue;
            }
            const float m_new = std::max(m[r], block_max);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; ++t) {
                const float p = sr[t] == kNegInf ? 0.0f : fast_exp(sr[t] - m_new);
                sr[t] = p;
                sum += p;
            }
            if (m_new != m[r]) {
                const float alpha = fast_exp(m[r] - m_new);
                float* ar = acc + r * dh;
#pragma omp simd
                for (int64_t d = 0; d < dh; ++d) ar[d] *= alpha;
                l[r] *= alpha;
                m[r] = m_new;
            }
            l[r] += sum;
        }
        for (int64_t t = 0; t < n; ++t) {
            const KT* vrow = vb + t * sh.kv_token_stride;
#pragma omp simd
            for (int64_t d = 0; d < dh; ++d) vf[d] = to_float(vrow[d]);
            for (int64_t r = 0; r < R; ++r) {
                const float p = sc[r * bs + t];
                float* ar = acc + r * dh;
#pragma omp simd
                for (int64_t d = 0; d < dh; ++d) ar[d] += p * vf[d];
            }
        }
    }

    if (partial_buf != nullptr) {  // layout per item: m[R], l[R], acc[R, dh]
        std::memcpy(partial_buf, m, R * sizeof(float));
        std::memcpy(partial_buf + R, l, R * sizeof(float));
        std::memcpy(partial_buf + 2 * R, acc, R * dh * sizeof(float));
        return;
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t j = r / G, h = r % G;
        QT* orow = out + (plan.q_start[s] + it.row0 + j) * sh.out_row_stride + (it.kv_head * G + h) * dh;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const float* ar = acc + r * dh;
        for (int64_t d = 0; d < dh; ++d) store(orow + d, ar[d] * inv);
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

// Cut the plan into items; split key ranges only when there are too few items for the threads.
int64_t make_items(const PsAttentionPlan& plan, const Shape& sh, int num_threads, std::vector<Item>& items) {
    const int64_t tile_rows = std::max<int64_t>(1, kMaxTileVectors / sh.group);
    int64_t base_items = 0, longest = 0;
    for (int64_t s = 0; s < plan.num_seqs; ++s) {
        base_items += (plan.q_len[s] + tile_rows - 1) / tile_rows * sh.num_kv_heads;
        longest = std::max<int64_t>(longest, plan.ctx_len[s]);
    }
    int64_t partition_keys = longest;  // no split
    const int64_t wanted = 4 * static_cast<int64_t>(num_threads);
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
            const bool split = last_part > first_part;
            for (int32_t g = 0; g < sh.num_kv_heads; ++g) {
                for (int64_t part = first_part; part <= last_part; ++part) {
                    Item it;
                    it.seq = static_cast<int32_t>(s);
                    it.row0 = static_cast<int32_t>(row0);
                    it.nrows = nrows;
                    it.kv_head = g;
                    it.key_lo = static_cast<int32_t>(std::max(lo, part * partition_keys));
                    it.key_hi = static_cast<int32_t>(std::min(hi, (part + 1) * partition_keys));
                    it.partial = split ? num_partials++ : -1;
                    it.cost = static_cast<int64_t>(it.key_hi - it.key_lo) * nrows;
                    items.push_back(it);
                }
            }
        }
    }
    return num_partials;
}

template <typename QT, typename KT, int DH>
void run_attention(const PsAttentionPlan& plan, const Shape& sh, const void* q, const void* k_cache,
                   const void* v_cache, void* out, int num_threads) {
    std::vector<Item> items;
    const int64_t num_partials = make_items(plan, sh, num_threads, items);
    const int64_t tile_vectors = std::max<int64_t>(1, kMaxTileVectors / sh.group) * sh.group;
    const int64_t partial_stride = tile_vectors * (sh.head_dim + 2);
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
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && n > 1)
    for (int64_t i = 0; i < n; ++i) {
        const Item& it = items[order[i]];
        attend_item<QT, KT, DH>(plan, sh, it, qp, kp, vp, op,
                                it.partial >= 0 ? partials.data() + it.partial * partial_stride : nullptr);
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
        case 64: run_attention<QT, KT, 64>(plan, sh, q, k_cache, v_cache, out, num_threads); break;
        case 128: run_attention<QT, KT, 128>(plan, sh, q, k_cache, v_cache, out, num_threads); break;
        default: run_attention<QT, KT, 0>(plan, sh, q, k_cache, v_cache, out, num_threads); break;
    }
    return 0;
}

}  // namespace

extern "C" {

int ps_abi_version() { return kAbiVersion; }

int ps_dtype_supported(int dtype) {
#ifdef __FLT16_MAX__
    return dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16;
#else
    return dtype == kFloat32 || dtype == kBFloat16;
#endif
}

// out[rows of the plan] = softmax(q k^T * scale) v over each sequence's blocks.
// q, out and the caches share one dtype. Returns 0, or -1 for a bad shape, -2 for an
// unsupported or mixed dtype.
int ps_paged_attention(const PsAttentionPlan* plan, const void* q, int64_t q_row_stride, int q_dtype,
                       const void* k_cache, const void* v_cache, int kv_dtype, void* out, int64_t out_row_stride,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || plan->block_size <= 0) return -1;
    if (plan->num_seqs == 0) return 0;
    Shape sh{num_heads, num_kv_heads, head_dim, num_heads / num_kv_heads,
             q_row_stride, out_row_stride, num_kv_heads * head_dim, scale};
    num_threads = std::max(1, num_threads);
    // q, out and the cache share one dtype (the model's): one instantiation per dtype keeps
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

// k_cache[slot_mapping[t]] = k[t] (and v alike) for t < num_tokens, whole token rows of
// row_bytes; sources may have a row stride (v is a view into the fused qkv output).
// A negative slot skips the token (padding).
void ps_write_kv(const void* k, int64_t k_row_stride_bytes, const void* v, int64_t v_row_stride_bytes,
                 void* k_cache, void* v_cache, const int64_t* slot_mapping, int64_t num_tokens, int64_t row_bytes,
                 int num_threads) {
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
        std::memcpy(kd + slot * row_bytes, ks + t * k_row_stride_bytes, row_bytes);
        std::memcpy(vd + slot * row_bytes, vs + t * v_row_stride_bytes, row_bytes);
    }
}

}  // extern "C"
