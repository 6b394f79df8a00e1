/*
 * gemm_forms.c — the few-row forms of the GEMM seam (gemm.h) against the plain calls they
 * replace, at a 128-px generation's shapes (24-128 rows) and their TP halves, on the weights' way
 * a forward reads them: each shape cycles through 24 distinct weight matrices (more than a 32 MiB
 * L3 holds), so weights come from memory. Per shape, alternating within each repeat, medians:
 *   plain     the usual oneDNN call, y = x . W^T (mdt_cpu_gemm_set_swap(0));
 *   swapped   the weights on the left, Ct = W . x^T then transposed (mdt_cpu_gemm_set_swap(1));
 *   rule      which of the two the shape rule (gemm.c) picks on this GEMM path;
 * and the largest difference between the two outputs. Then one-row products (y [1, N] = x [1, K]
 * . W^T): the GEMM library's call (mdt_cpu_gemm_run) against the kernel set's row product that
 * the seam takes for one row (mdt_cpu_gemm_linear_f32), as weight bytes read per second.
 * Benchmarks only (never in make test). Set MESHDIT_CPU_GEMM=onednn-avx2 for oneDNN's AVX2
 * kernels.
 * usage: build/bench/gemm_forms [repeats [MxNxK ...]]   (shapes given: those only, no rows)
 */
#include "bench_stats.h"
#include "core/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { NW = 24, MAXREP = 64 };

/* one [M, K] . [K, N] shape, both forms; prints a table row */
static int shape(int64_t M, int64_t N, int64_t K, int reps) {
    float *x = mdt_bench_filled(M * K, 3), *b = mdt_bench_filled(N, 5),
          *y[2] = {malloc(sizeof(float) * M * N), malloc(sizeof(float) * M * N)};
    float *w[NW];
    int ok = x && b && y[0] && y[1];
    for (int i = 0; i < NW; i++)
        ok = (w[i] = mdt_bench_filled(N * K, i)) != NULL && ok;
    if (!ok) {
        printf("gemm_forms: out of memory at [%lld x %lld] . [%lld x %lld]\n", (long long)M,
               (long long)K, (long long)K, (long long)N);
        return 1;
    }
    double t[2][MAXREP];
    for (int rep = -1; rep < reps; rep++) /* rep -1 warms up (primitives, first touch) */
        for (int f = 0; f < 2; f++) {
            mdt_cpu_gemm_set_swap(f);
            const double t0 = mdt_now();
            for (int i = 0; i < NW; i++)
                mdt_cpu_gemm_linear_f32(x, K, w[i], b, y[f], N, M, K, N); // [M, N]
            if (rep >= 0)
                t[f][rep] = mdt_now() - t0;
        }
    double diff = 0; /* both forms of the last weight matrix */
    for (int64_t i = 0; i < M * N; i++)
        diff = fmax(diff, fabs((double)y[0][i] - (double)y[1][i]));
    mdt_cpu_gemm_set_swap(-1);
    const int64_t before = mdt_cpu_gemm_swapped();
    mdt_cpu_gemm_linear_f32(x, K, w[0], b, y[1], N, M, K, N);
    const int rule = mdt_cpu_gemm_swapped() > before;
    const double fl = 2.0 * (double)(M * N * K) * NW * 1e-9;
    const double plain = fl / mdt_bench_median(t[0], reps),
                 swapped = fl / mdt_bench_median(t[1], reps);
    printf("| %lld x %lld . %lld x %lld | %.1f | %.1f (%.2fx) | %s | %.1e |\n", (long long)M,
           (long long)K, (long long)K, (long long)N, plain, swapped, swapped / plain,
           rule ? "swapped" : "plain", diff);
    for (int i = 0; i < NW; i++)
        free(w[i]);
    free(x), free(b), free(y[0]), free(y[1]);
    return 0;
}

/* one row: the library's call against the row product, weight GB/s */
static int row(int64_t N, int64_t K, int reps) {
    float *x = mdt_bench_filled(K, 3), *b = mdt_bench_filled(N, 5),
          *y[2] = {malloc(sizeof(float) * N), malloc(sizeof(float) * N)};
    float *w[NW];
    int ok = x && b && y[0] && y[1];
    for (int i = 0; i < NW; i++)
        ok = (w[i] = mdt_bench_filled(N * K, i)) != NULL && ok;
    if (!ok) {
        printf("gemm_forms: out of memory at one row of [%lld x %lld]\n", (long long)N,
               (long long)K);
        return 1;
    }
    double t[2][MAXREP];
    for (int rep = -1; rep < reps; rep++)
        for (int f = 0; f < 2; f++) {
            const double t0 = mdt_now();
            for (int i = 0; i < NW; i++) {
                if (f == 0) { /* the library: bias first, then the product accumulated */
                    for (int64_t n = 0; n < N; n++)
                        y[0][n] = b[n];
                    mdt_cpu_gemm_run(0, 1, 1, N, K, 1.0f, x, K, w[i], K, 1.0f, y[0], N);
                } else {
                    mdt_cpu_gemm_linear_f32(x, K, w[i], b, y[1], N, 1, K, N); // [1, N]
                }
            }
            if (rep >= 0)
                t[f][rep] = mdt_now() - t0;
        }
    double diff = 0;
    for (int64_t n = 0; n < N; n++)
        diff = fmax(diff, fabs((double)y[0][n] - (double)y[1][n]));
    const double gb = 4.0 * (double)(N * K) * NW * 1e-9;
    const double lib = gb / mdt_bench_median(t[0], reps), own = gb / mdt_bench_median(t[1], reps);
    printf("| 1 x %lld . %lld x %lld | %.1f | %.1f (%.2fx) | %s | %.1e |\n", (long long)K,
           (long long)K, (long long)N, lib, own, own / lib,
           mdt_cpu_kernel_set_get()->gemv_f32 ? "row product" : "library", diff);
    for (int i = 0; i < NW; i++)
        free(w[i]);
    free(x), free(b), free(y[0]), free(y[1]);
    return 0;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    reps = reps < 1 ? 1 : reps > MAXREP ? MAXREP : reps;
    char gd[96];
    mdt_cpu_gemm_describe(gd, sizeof gd);
    printf("gemm path: %s; kernels %s; %d weight matrices a shape, medians of %d\n", gd,
           mdt_cpu_kernel_set_get()->k.name, NW, reps);
    printf("| M x K . K x N | plain GFLOP/s | weights on the left | the rule takes | max abs "
           "diff |\n|---|---|---|---|---|\n");
    const int64_t shapes[][3] = {
        {16, 1024, 1024},  {24, 1024, 1024}, {32, 1024, 1024},  {48, 1024, 1024}, {64, 1024, 1024},
        {80, 1024, 1024},  {96, 1024, 1024}, {128, 1024, 1024}, {32, 4096, 1024}, {64, 4096, 1024},
        {96, 4096, 1024},  {16, 1024, 4096}, {32, 1024, 4096},  {64, 1024, 4096}, {96, 1024, 4096},
        {128, 1024, 4096}, {32, 1024, 2048}, {96, 1024, 2560},  {32, 512, 1024},  {96, 512, 2048}};
    int bad = 0;
    if (argc > 2) /* the shapes asked for */
        return mdt_bench_shape_args("gemm_forms", argv + 2, argc - 2, shape, reps);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) /* {M, N, K} */
        bad |= shape(shapes[s][0], shapes[s][1], shapes[s][2], reps);
    printf("\n| one row: 1 x K . K x N | library GB/s of weights | the row product | the seam "
           "takes | max abs diff |\n|---|---|---|---|---|\n");
    const int64_t rows[][2] = {{1024, 1024}, {6144, 1024}, {3072, 1024}, {1024, 256}};
    for (size_t s = 0; s < sizeof rows / sizeof rows[0]; s++) /* {N, K} */
        bad |= row(rows[s][0], rows[s][1], reps);
    return bad;
}
