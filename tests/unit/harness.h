/*
 * harness.h — a minimal test harness: EXPECT_* record failures without stopping, each test
 * binary ends with TEST_END() printing "N passed, N failed" and exiting non-zero on any failure.
 */
#ifndef MDT_TEST_HARNESS_H
#define MDT_TEST_HARNESS_H

#include <math.h>
#include <stdio.h>
#include <string.h>

static int t_pass, t_fail;

#define EXPECT(cond, ...)                                                                          \
    do {                                                                                           \
        if (cond) {                                                                                \
            t_pass++;                                                                              \
        } else {                                                                                   \
            t_fail++;                                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

#define EXPECT_OK(expr)                                                                            \
    do {                                                                                           \
        mdt_status t_st_ = (expr);                                                                 \
        EXPECT(t_st_ == MDT_OK, "%s -> %s: %s", #expr, mdt_status_str(t_st_), mdt_last_error());   \
    } while (0)

/* The call fails with `code` and its message contains every listed substring. */
#define EXPECT_ERR(expr, code, ...)                                                                \
    do {                                                                                           \
        mdt_status t_st_ = (expr);                                                                 \
        const char *t_subs_[] = {__VA_ARGS__, NULL};                                               \
        int t_ok_ = t_st_ == (code);                                                               \
        for (int t_i_ = 0; t_ok_ && t_subs_[t_i_]; t_i_++)                                         \
            t_ok_ = strstr(mdt_last_error(), t_subs_[t_i_]) != NULL;                               \
        EXPECT(t_ok_, "%s -> %s: '%s' (wanted %s)", #expr, mdt_status_str(t_st_),                  \
               mdt_last_error(), mdt_status_str(code));                                            \
    } while (0)

/* max|a-b| / max(max|b|, floor) <= tol */
static inline double t_rel_err(const float *a, const float *b, long n, double floor_) {
    double md = 0, mb = floor_;
    for (long i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md))
            md = d; /* NaN propagates as a failure */
        if (fabs(b[i]) > mb)
            mb = fabs(b[i]);
    }
    return md / mb;
}

#define EXPECT_CLOSE(a, b, n, tol)                                                                 \
    do {                                                                                           \
        double t_e_ = t_rel_err((a), (b), (long)(n), 1e-30);                                       \
        EXPECT(t_e_ <= (tol), "relative error %.3e > %.1e", t_e_, (double)(tol));                  \
    } while (0)

#define TEST_END()                                                                                 \
    do {                                                                                           \
        printf("%s: %d passed, %d failed\n", __FILE__, t_pass, t_fail);                            \
        return t_fail ? 1 : 0;                                                                     \
    } while (0)

/* TEST_END for an MPI test (tests/mpi; the file includes mpi.h): failures summed over the world,
 * MPI finalized, rank 0 prints the line for all; every rank exits non-zero on any failure. */
#define MPI_TEST_END(rank)                                                                         \
    do {                                                                                           \
        int t_any_ = 0;                                                                            \
        MPI_Allreduce(&t_fail, &t_any_, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);                      \
        MPI_Finalize();                                                                            \
        if ((rank) != 0)                                                                           \
            return t_any_ ? 1 : 0;                                                                 \
        t_fail = t_any_;                                                                           \
        TEST_END();                                                                                \
    } while (0)

#endif /* MDT_TEST_HARNESS_H */
