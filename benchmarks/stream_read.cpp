// A plain streaming read, the bandwidth reference beside the GEMM in benchmarks/cpu_gemm.py
// --cold: each of `threads` OpenMP threads sums its own contiguous slice of n floats (one
// slice per thread, as the GEMM's threads split the panels), eight vector accumulators so the
// adds never wait, nothing written; with `ahead` > 0 each line is also prefetched into L2
// that many bytes ahead (a second reference: on some CPUs the hardware prefetchers alone
// leave bandwidth unused). Built by cpu_gemm.py with pagedserve/native.py's flags.
#include <cstdint>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" double ps_stream_read(const float* p, int64_t n, int threads, int64_t ahead) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total) if (threads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lines = n / 16;  // whole 64-byte lines (16 floats)
        const int64_t begin = lines * t / nt * 16, end = lines * (t + 1) / nt * 16;
#if defined(__AVX512F__)
        __m512 acc[8];
        for (auto& a : acc) a = _mm512_setzero_ps();
        int64_t i = begin;
        const char* base = reinterpret_cast<const char*>(p) + ahead;
        for (; i + 128 <= end; i += 128)
            for (int j = 0; j < 8; ++j) {
                if (ahead) __builtin_prefetch(base + 4 * (i + 16 * j), 0, 1);
                acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(p + i + 16 * j));
            }
        for (; i < end; i += 16) acc[0] = _mm512_add_ps(acc[0], _mm512_loadu_ps(p + i));
        for (int j = 1; j < 8; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
        total += _mm512_reduce_add_ps(acc[0]);
#else
        float acc = 0.0f;
        for (int64_t i = begin; i < end; ++i) acc += p[i];  // vectorised: -fassociative-math
        total += acc;
#endif
    }
    return total;
}

// The FLOP reference beside it: `threads` threads each run `iters` rounds of 16 independent
// vector FMAs (no loads, no stores: the core's FMA issue rate alone); returns the FLOPs done.
// cpu_gemm.py --cold divides by the wall time of the call for GFLOP/s at that thread count.
extern "C" double ps_fma_peak(int threads, int64_t iters) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total) if (threads > 1)
    {
#if defined(__AVX512F__)
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(0.001f * j);
        const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
        for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
        float sum = 0.0f;
        for (int j = 0; j < 16; ++j) sum += _mm512_reduce_add_ps(acc[j]);
        __asm__ volatile("" : : "x"(sum));  // keeps the loop alive
        total += double(iters) * 16 * 32;
#else
        float acc[16][8];
        for (int j = 0; j < 16; ++j)
            for (int l = 0; l < 8; ++l) acc[j][l] = 0.001f * j;
        for (int64_t i = 0; i < iters; ++i)
            for (int j = 0; j < 16; ++j)
                for (int l = 0; l < 8; ++l) acc[j][l] = __builtin_fmaf(acc[j][l], 0.999f, 1e-4f);
        float sum = 0.0f;
        for (int j = 0; j < 16; ++j) sum += acc[j][0];
        __asm__ volatile("" : : "x"(sum));
        total += double(iters) * 16 * 8 * 2;
#endif
    }
    return total;
}
