// One layer's decode attention through paged_attention.cpp's C ABI, timed in thread CPU time (and
// wall): the figures behind benchmarks/README.md's "CPU paged attention: memory-level parallelism"
// section. 246M shape (16 heads, 4 kv heads x 64, block 16), shuffled block ids; cold = enough
// separate layer pools (256 MB) rotated that K/V come from DRAM, as in a forward.
//
//   g++ -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -fassociative-math \
//       -fno-signed-zeros -std=c++17 [-DKERNEL='"other/paged_attention.cpp"'] \
//       benchmarks/attention_tiles.cpp -o /tmp/attention_tiles
//   OMP_NUM_THREADS=1 /tmp/attention_tiles SEQS CTX DTYPE(0 fp32, 1 bf16) THREADS COLD(0/1) [REPEATS]
//
// Build it from two checkouts and alternate the binaries; `chk` (a checksum of the output bytes)
// is equal when two builds give bit-identical outputs.
#ifndef KERNEL
#define KERNEL "../pagedserve/attention/cpu/paged_attention.cpp"
#endif
#include KERNEL
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <algorithm>
static double tcpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static double wall() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
    int S = atoi(argv[1]), ctx = atoi(argv[2]), dt = atoi(argv[3]), threads = atoi(argv[4]);
    int cold = atoi(argv[5]); int reps = argc > 6 ? atoi(argv[6]) : 20;
    const int H = 16, KV = 4, D = 64, bs = 16;
    int esz = dt == 0 ? 4 : 2;
    int bps = (ctx + bs - 1) / bs;
    int nblocks = S * bps + 8;
    int64_t tok = KV * D, slots = (int64_t)nblocks * bs;
    size_t layer_bytes = 2 * slots * tok * esz;
    int L = cold ? std::max<int64_t>(1, (256ll << 20) / layer_bytes) : 1;
    std::mt19937 rng(1);
    std::vector<int> ids(nblocks); for (int i = 0; i < nblocks; ++i) ids[i] = i; std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> table(S * bps), qs(S), ql(S, 1), cl(S, ctx);
    for (int s = 0; s < S; ++s) { qs[s] = s; for (int b = 0; b < bps; ++b) table[s * bps + b] = ids[s * bps + b]; }
    std::vector<char*> k(L), v(L);
    std::normal_distribution<float> nd;
    for (int l = 0; l < L; ++l) {
        k[l] = (char*)aligned_alloc(64, slots * tok * esz); v[l] = (char*)aligned_alloc(64, slots * tok * esz);
        for (int64_t i = 0; i < slots * tok; ++i) {
            float a = nd(rng), b = nd(rng);
            if (dt == 0) { ((float*)k[l])[i] = a; ((float*)v[l])[i] = b; }
            else { uint32_t ua, ub; memcpy(&ua, &a, 4); memcpy(&ub, &b, 4); ((uint16_t*)k[l])[i] = ua >> 16; ((uint16_t*)v[l])[i] = ub >> 16; }
        }
    }
    std::vector<char> q(S * H * D * esz), out(S * H * D * esz);
    for (int i = 0; i < S * H * D; ++i) { float a = nd(rng); if (dt == 0) ((float*)q.data())[i] = a; else { uint32_t u; memcpy(&u, &a, 4); ((uint16_t*)q.data())[i] = u >> 16; } }
    PsAttentionPlan plan{S, qs.data(), ql.data(), cl.data(), table.data(), bps, bs, 0};
    double best_c = 1e9, best_w = 1e9, sum_c = 0; int n = 0;
    double chk = 0;
    for (int r = 0; r < reps; ++r) {
        for (int l = 0; l < L; ++l) {
            double c0 = tcpu(), w0 = wall();
            ps_paged_attention(&plan, q.data(), H * D, dt, k[l], v[l], bs * tok, D, tok, dt, out.data(), H * D, H, KV, D, 0.125f, nullptr, nullptr, 0, 1, 1, threads);
            double c1 = tcpu(), w1 = wall();
            if (r > 0) { best_c = std::min(best_c, c1 - c0); best_w = std::min(best_w, w1 - w0); sum_c += c1 - c0; ++n; }
        }
    }
    for (size_t i = 0; i < out.size(); ++i) chk += (unsigned char)out[i];
    printf("S=%d ctx=%d dt=%d thr=%d cold=%d L=%d  cpu min %.1f us mean %.1f us  wall min %.1f us  MB/layer %.1f  chk %.0f\n", S, ctx, dt, threads, cold, L, best_c * 1e6, sum_c / n * 1e6, best_w * 1e6, layer_bytes / 1e6 * (double)(S*bps*bs)/slots, chk);
}
