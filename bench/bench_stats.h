/*
 * bench_stats.h — what the GEMM benches share: the median of a run's repeat times and the
 * deterministic fill of their operands (header-only; each bench is one translation unit).
 */
#ifndef MDT_BENCH_STATS_H
#define MDT_BENCH_STATS_H

#include <stdint.h>
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

#endif /* MDT_BENCH_STATS_H */
