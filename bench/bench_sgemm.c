/*
 * bench_sgemm.c — this machine's single-thread GEMM rates at the GEMM shapes of the medium Flux
 * forward (M = 1280 tokens, K/N in {1024, 4096, 5120}), so a forward's achieved GFLOP/s can be
 * read as a fraction of the limit: OpenBLAS sgemm, then the GEMM path meshdit uses (gemm.h) in
 * f32 and, where it multiplies bf16 operands, in bf16, and in f32 at the shapes of a 2-rank
 * layout's shards (CP: half the rows; TP: half of N or K). Prints one line per shape and the median
 * over shapes, then the CPU model and its vector flags, the core's fp32 FMA peak (12 independent
 * FMA chains, all in registers; 8-wide and, with AVX-512, 16-wide) and its bf16 dot-product peak
 * (vdpbf16ps, AVX512-BF16): ceilings no GEMM can pass except through AMX's tile unit.
 * usage: build/bench/bench_sgemm [repeats]
 */
#include "core/core.h"
#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* fp32 FLOP/s of fused multiply-adds alone: 12 chains hide the FMA latency on both pipes.
 * Compiled for AVX2 + FMA whatever the build's baseline; main checks the CPU has them. */
__attribute__((target("avx2,fma"))) static double fma_peak(void) {
    __m256 acc[12];
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        acc[i] = _mm256_set1_ps((float)i);
    const long iters = 50000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = mdt_now();
        for (long n = 0; n < iters; n++)
            for (int i = 0; i < 12; i++)
                acc[i] = _mm256_fmadd_ps(acc[i], m, c);
        const double rate = (double)iters * 12 * 16 / (mdt_now() - t0) * 1e-9;
        best = rate > best ? rate : best;
    }
    float sink[8];
    __m256 s = acc[0];
    for (int i = 1; i < 12; i++)
        s = _mm256_add_ps(s, acc[i]);
    _mm256_storeu_ps(sink, s);
    return sink[0] == sink[0] ? best : 0; /* uses the result, so the loop stays */
}

/* The same with 16-wide FMAs (AVX-512). */
__attribute__((target("avx512f"))) static double fma512_peak(void) {
    __m512 acc[12];
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        acc[i] = _mm512_set1_ps((float)i);
    const long iters = 25000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = mdt_now();
        for (long n = 0; n < iters; n++)
            for (int i = 0; i < 12; i++)
                acc[i] = _mm512_fmadd_ps(acc[i], m, c);
        const double rate = (double)iters * 12 * 32 / (mdt_now() - t0) * 1e-9;
        best = rate > best ? rate : best;
    }
    __m512 s = acc[0];
    for (int i = 1; i < 12; i++)
        s = _mm512_add_ps(s, acc[i]);
    return _mm512_reduce_add_ps(s) == _mm512_reduce_add_ps(s) ? best : 0;
}

/* bf16 dot products: vdpbf16ps does 16 lanes x 2 products, 64 FLOP per instruction. */
__attribute__((target("avx512f,avx512bf16"))) static double bf16_dot_peak(void) {
    __m512 acc[12];
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a; /* pairs of 1.0 */
    for (int i = 0; i < 12; i++)
        acc[i] = _mm512_set1_ps((float)i);
    const long iters = 25000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = mdt_now();
        for (long n = 0; n < iters; n++)
            for (int i = 0; i < 12; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        const double rate = (double)iters * 12 * 64 / (mdt_now() - t0) * 1e-9;
        best = rate > best ? rate : best;
    }
    __m512 s = acc[0];
    for (int i = 1; i < 12; i++)
        s = _mm512_add_ps(s, acc[i]);
    return _mm512_reduce_add_ps(s) == _mm512_reduce_add_ps(s) ? best : 0;
}

/* The CPU model and the vector flags that decide meshdit's paths, from /proc/cpuinfo. */
static void print_cpu(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192], model[256] = "?", flags[8192] = "";
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0 && model[0] == '?')
            snprintf(model, sizeof model, "%s", strchr(line, ':') + 2);
        if (strncmp(line, "flags", 5) == 0 && !flags[0])
            snprintf(flags, sizeof flags, "%s", line);
    }
    if (f)
        fclose(f);
    model[strcspn(model, "\n")] = '\0';
    printf("cpu: %s; flags:", model);
    const char *want[] = {"avx2",        "fma",         "avx512f",  "avx512bw",
                          "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"};
    for (int i = 0; i < 8; i++) {
        char pat[32];
        snprintf(pat, sizeof pat, " %s", want[i]);
        const char *p = strstr(flags, pat);
        if (p && (p[strlen(pat)] == ' ' || p[strlen(pat)] == '\n'))
            printf(" %s", want[i]);
    }
    printf("\n");
}

/* Median rate of mdt_cpu_gemm_run at [M, K] . [N, K]^T, bf16 or f32 operands. */
static double path_rate(int bf16, int M, int N, int K, int reps) {
    const size_t el = bf16 ? 2 : 4;
    char *a = calloc((size_t)M * K, el), *b = calloc((size_t)N * K, el);
    float *c = malloc(sizeof(float) * (size_t)M * N);
    for (long i = 0; i < (long)M * K; i += 3)
        a[i * (long)el + (long)el - 1] = 0x3c; /* small values in either format */
    for (long i = 0; i < (long)N * K; i += 5)
        b[i * (long)el + (long)el - 1] = 0x3c;
    double *t = malloc(sizeof(double) * (size_t)reps);
    for (int r = -1; r < reps; r++) {
        const double t0 = mdt_now();
        mdt_cpu_gemm_run(bf16, 1, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N);
        if (r >= 0)
            t[r] = mdt_now() - t0;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp);
    const double rate = 2.0 * M * N * K / t[reps / 2] * 1e-9;
    free(a), free(b), free(c), free(t);
    return rate;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    const int shapes[][3] = {{1280, 1024, 1024},
                             {1280, 4096, 1024},
                             {1280, 1024, 4096},
                             {1280, 1024, 5120},
                             {1024, 6144, 1024}};
    enum { NS = sizeof shapes / sizeof shapes[0] };
    double rates[NS];
    if (reps < 1)
        reps = 1;
    for (int s = 0; s < NS; s++) {
        int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        float *a = malloc(sizeof(float) * (size_t)M * K),
              *b = malloc(sizeof(float) * (size_t)N * K),
              *c = malloc(sizeof(float) * (size_t)M * N);
        for (long i = 0; i < (long)M * K; i++)
            a[i] = (float)(i % 17) * 0.01f;
        for (long i = 0; i < (long)N * K; i++)
            b[i] = (float)(i % 13) * 0.01f;
        double *t = malloc(sizeof(double) * (size_t)reps);
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
            double t0 = mdt_now();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a, K, b, K, 0.0f, c,
                        N);
            if (r >= 0)
                t[r] = mdt_now() - t0;
        }
        qsort(t, (size_t)reps, sizeof(double), cmp);
        rates[s] = 2.0 * M * N * K / t[reps / 2] * 1e-9;
        printf("sgemm M=%d N=%d K=%d: median %.4f s, %.1f GFLOP/s\n", M, N, K, t[reps / 2],
               rates[s]);
        free(a), free(b), free(c), free(t);
    }
    qsort(rates, NS, sizeof(double), cmp);
    const double sg = rates[NS / 2];
    printf("sgemm median rate: %.1f GFLOP/s\n", sg);
    char gd[96];
    mdt_cpu_gemm_describe(gd, sizeof gd);
    for (int bf16 = 0; bf16 <= mdt_cpu_gemm_bf16_operands(); bf16++) {
        double pr[NS];
        for (int s = 0; s < NS; s++)
            pr[s] = path_rate(bf16, shapes[s][0], shapes[s][1], shapes[s][2], reps);
        qsort(pr, NS, sizeof(double), cmp);
        printf("gemm %s %s median rate: %.1f GFLOP/s\n", bf16 ? "bf16" : "f32", gd, pr[NS / 2]);
    }
    /* the same shapes as a 2-rank layout's shards: CP halves the rows, TP halves N of the
     * column-split linears (the first, second and last shape) and K of the row-split ones */
    double cp[NS], tp[NS];
    for (int s = 0; s < NS; s++) {
        const int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2], row = s == 2 || s == 3;
        cp[s] = path_rate(0, M / 2, N, K, reps);
        tp[s] = path_rate(0, M, row ? N : N / 2, row ? K / 2 : K, reps);
    }
    qsort(cp, NS, sizeof(double), cmp);
    qsort(tp, NS, sizeof(double), cmp);
    printf("gemm f32 %s at the 2-rank shards' shapes: cp2 (rows / 2) %.1f, tp2 (N or K / 2) %.1f "
           "GFLOP/s (medians over the shapes)\n",
           gd, cp[NS / 2], tp[NS / 2]);
    print_cpu();
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        printf("fma peak: not measured (no AVX2 + FMA on this CPU)\n");
        return 0;
    }
    const double peak = fma_peak();
    const double p512 = __builtin_cpu_supports("avx512f") ? fma512_peak() : 0.0;
    const double best = p512 > peak ? p512 : peak;
    printf("fma peak: %.1f GFLOP/s (one thread; 8-wide %.1f, 16-wide %.1f); sgemm median = "
           "%.0f%% of it\n",
           best, peak, p512, 100.0 * sg / best);
    if (__builtin_cpu_supports("avx512bf16"))
        printf("bf16 dot peak: %.1f GFLOP/s (vdpbf16ps, one thread)\n", bf16_dot_peak());
    else
        printf("bf16 dot peak: not measured (no AVX512-BF16 on this CPU)\n");
    return 0;
}
