/*
 * bench_stats.h — what the GEMM benches share: the median of a run's repeat times, the
 * deterministic fill of their operands and the shapes named on the command line (header-only;
 * each bench is one translation unit).
 */
#ifndef MDT_BENCH_STATS_H
#define MDT_BENCH_STATS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static inline int mdt_bench_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of t [n] (sorts t). */
static inline double mdt_bench_median(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, mdt_bench_cmp);
    return t[n / 2];
}

/* n floats in [-0.5, 0.5), a pattern per seed; NULL when out of memory. */
static inline float *mdt_bench_filled(int64_t n, int64_t seed) {
    float *p = malloc(sizeof(float) * (size_t)n); // [n]
    for (int64_t i = 0; p && i < n; i++)
        p[i] = (float)((i * 7 + seed) % 101) / 101.0f - 0.5f;
    return p;
}

/* Runs shape(M, N, K, reps) for each "MxNxK" in args [n]; OR of the results, or 2 (with one
 * line naming `bench` and the argument) at the first argument that is not three positive
 * integers. */
static inline int mdt_bench_shape_args(const char *bench, char **args, int n,
                                       int (*shape)(int64_t, int64_t, int64_t, int), int reps) {
    int bad = 0;
    for (int a = 0; a < n; a++) {
        long long M, N, K;
        if (sscanf(args[a], "%lldx%lldx%lld", &M, &N, &K) != 3 || M < 1 || N < 1 || K < 1) {
            printf("%s: %s: expected MxNxK (three positive integers)\n", bench, args[a]);
            return 2;
        }
        bad |= shape(M, N, K, reps);
    }
    return bad;
}

#endif /* MDT_BENCH_STATS_H */
