/*
 * cpu_backend.c — see cpu_backend.h. The bf16 scratch is grown by mdt_backend_reserve_linear at
 * load time; a forward that finds it short grows it, and if that fails the failure is kept for
 * mdt_backend_check, like an asynchronous device error.
 */
#include "cpu_backend.h"

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_bf16;
static float *g_lin_ws;
static int64_t g_lin_ws_n;
static char g_err[160];
static mdt_status g_err_code; /* the code g_err is reported with */
/* mdt_k_shared_begin's input, rounded to bf16 once (g_sh_h [M, K]) */
static struct {
    const float *x;
    int64_t ldx, M, K;
} g_sh;
static uint16_t *g_sh_h;
static int64_t g_sh_n;
static int g_sh_depth; /* nested begins on the same x */
/* The weights held packed (gemm.h: prepacked weights), sorted by address: a linear whose w is
 * one of them runs on the packed layout; a pointer inside one (a view of its rows) is refused. */
typedef struct {
    const float *p;
    int64_t floats, N, K;
} packed_w;
static packed_w *g_pk;
static int g_npk, g_pk_cap;
static int g_pack_on = 1; /* new weights are packed (MESHDIT_CPU_PACK, backend.c) */

static int lin_ws_grow(int64_t floats) {
    if (floats <= g_lin_ws_n)
        return 0;
    float *p = mdt_alloc(sizeof(float) * (size_t)floats);
    if (!p)
        return -1;
    mdt_free(g_lin_ws);
    g_lin_ws = p, g_lin_ws_n = floats;
    return 0;
}

void mdt_cpu_backend_release(void) {
    mdt_free(g_lin_ws);
    g_lin_ws = NULL, g_lin_ws_n = 0;
    mdt_free(g_sh_h);
    g_sh_h = NULL, g_sh_n = 0, g_sh.x = NULL;
    mdt_cpu_gemm_release();
}

void mdt_cpu_backend_start(int bf16) {
    g_bf16 = bf16, g_err[0] = '\0';
    mdt_cpu_backend_release();
}

int64_t mdt_cpu_backend_scratch_bytes(void) { return g_lin_ws_n * 4; }

mdt_status mdt_cpu_backend_measure_bf16(int *operands, double *t_ops, double *t_widen, int *asked) {
    *operands = 0, *t_ops = *t_widen = 0, *asked = 0;
    const char *env = getenv("MESHDIT_CPU_BF16");
    const int possible = mdt_cpu_gemm_bf16_operands_possible();
    if (env && *env && strcmp(env, "auto") != 0) {
        if (strcmp(env, "operands") != 0 && strcmp(env, "widen") != 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "MESHDIT_CPU_BF16='%s': operands, widen or auto (the default)", env);
        if (strcmp(env, "operands") == 0 && !possible)
            return MDT_FAIL(MDT_E_UNSUPPORTED,
                            "MESHDIT_CPU_BF16=operands: this CPU GEMM path (%s) has no bf16 "
                            "GEMM; bf16 weights are widened to f32 here",
                            mdt_cpu_gemm());
        *operands = strcmp(env, "operands") == 0, *asked = 1;
        return MDT_OK;
    }
    if (!possible)
        return MDT_OK;
    enum { M = 256, K = 1024, N = 1024 };
    const int prev = mdt_cpu_gemm_bf16_operands();
    float *x = mdt_alloc(sizeof(float) * M * K), *y = mdt_alloc(sizeof(float) * M * N);
    uint16_t *wh = mdt_alloc(sizeof(uint16_t) * N * K);
    int64_t wsf = 0;
    for (int op = 0; op < 2; op++) {
        mdt_cpu_gemm_set_bf16_operands(op, NULL);
        const int64_t need = mdt_cpu_backend_linear_bf16_ws_floats(M, K, N);
        wsf = need > wsf ? need : wsf;
    }
    float *ws = mdt_alloc(sizeof(float) * (size_t)wsf);
    mdt_status st = MDT_OK;
    if (!x || !y || !wh || !ws)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory for the bf16 path's measurement");
    for (int64_t i = 0; st == MDT_OK && i < (int64_t)M * K; i++)
        x[i] = (float)((i * 7919) % 2003) / 2003.0f - 0.5f;
    for (int64_t r = 0; st == MDT_OK && r < N; r += M) { /* M rows of weights at a time, in y */
        for (int64_t i = 0; i < (int64_t)M * K; i++)     /* (K = N: y holds M x K) */
            y[i] = (float)(((r * K + i) * 104729) % 1999) / 1999.0f - 0.5f;
        mdt_cpu_kernel_set_get()->to_bf16_rows(wh + r * K, K, y, K, M, K);
    }
    double best[2] = {1e30, 1e30};
    for (int round = 0; st == MDT_OK && round < 4; round++) /* round 0 warms both up */
        for (int op = 0; op < 2; op++) {
            mdt_cpu_gemm_set_bf16_operands(op, NULL);
            /* CPU time, not wall time: a rank descheduled by another process (ranks
             * oversubscribing the cores) would otherwise flip the verdict and, with it, the
             * arithmetic of the run: the same command must give the same bits */
            const double t0 = mdt_thread_cpu_seconds();
            mdt_cpu_backend_linear_bf16(x, K, wh, NULL, y, N, M, K, N, ws, wsf);
            const double t = mdt_thread_cpu_seconds() - t0;
            if (round > 0 && t < best[op])
                best[op] = t;
        }
    mdt_cpu_gemm_set_bf16_operands(prev, NULL);
    mdt_free(x), mdt_free(y), mdt_free(wh), mdt_free(ws);
    if (st == MDT_OK)
        *t_widen = best[0], *t_ops = best[1],
        *operands = best[1] < 0.9 * best[0]; /* a clear win only: near a tie, the more exact
                                              * widening, the same pick run after run */
    return st;
}

int64_t mdt_cpu_backend_linear_bf16_ws_floats(int64_t M, int64_t K, int64_t N) {
    if (mdt_cpu_gemm_bf16_operands())
        return (M * K + 1) / 2 > 1 ? (M * K + 1) / 2 : 1;
    return mdt_cpu_kernel_set_get()->linear_bf16_ws_floats(K, N);
}

void mdt_cpu_backend_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b,
                                 float *y, int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws,
                                 int64_t ws_floats) {
    if (mdt_cpu_gemm_bf16_operands())
        mdt_cpu_gemm_linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, (uint16_t *)(void *)ws,
                                 ws_floats * 2);
    else
        mdt_cpu_kernel_set_get()->linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, ws, ws_floats);
}

mdt_status mdt_cpu_backend_reserve_linear(int64_t K, int64_t N) {
    if (!g_bf16)
        return MDT_OK;
    const int64_t need = mdt_cpu_backend_linear_bf16_ws_floats(0, K, N); /* rows: a forward's */
    if (lin_ws_grow(need) != 0)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for %lld bytes of bf16 widening scratch",
                        (long long)need * 4);
    return MDT_OK;
}

mdt_status mdt_cpu_backend_check(void) {
    if (g_err[0]) { /* the message is formatted before the sticky error is cleared */
        const mdt_status st = MDT_FAIL(g_err_code, "%s", g_err);
        g_err[0] = '\0';
        return st;
    }
    const char *gemm_err = mdt_cpu_gemm_error();
    if (gemm_err)
        return MDT_FAIL(MDT_E_INVALID, "CPU GEMM: %s", gemm_err);
    return MDT_OK;
}

void mdt_cpu_backend_shared_begin(const float *x, int64_t ldx, int64_t M, int64_t K) {
    if (g_sh_depth > 0 && g_sh.x == x && g_sh.ldx == ldx && g_sh.M == M && g_sh.K == K) {
        g_sh_depth++; /* nested on the same input: already rounded */
        return;
    }
    g_sh.x = NULL, g_sh_depth = 0;
    if (!g_bf16 || !mdt_cpu_gemm_bf16_operands() || M <= 0 || K <= 0)
        return;
    if (M * K > g_sh_n) { /* grows on the first forward, then stays */
        uint16_t *p = mdt_alloc(sizeof(uint16_t) * (size_t)(M * K));
        if (!p)
            return; /* the linears round x themselves */
        mdt_free(g_sh_h);
        g_sh_h = p, g_sh_n = M * K;
    }
    mdt_cpu_kernel_set_get()->to_bf16_rows(g_sh_h, K, x, ldx, M, K); // [M, K]
    g_sh.x = x, g_sh.ldx = ldx, g_sh.M = M, g_sh.K = K, g_sh_depth = 1;
}

void mdt_cpu_backend_shared_end(void) {
    if (g_sh_depth > 0 && --g_sh_depth > 0)
        return;
    g_sh.x = NULL, g_sh_depth = 0;
}

void mdt_cpu_backend_set_pack(int on) { g_pack_on = on != 0; }

int64_t mdt_cpu_backend_packed_floats(int64_t N, int64_t K) {
    return g_bf16 || !g_pack_on ? 0 : mdt_cpu_gemm_packed_floats(N, K);
}

/* The table's memory goes once it holds nothing. */
static void pk_release_if_empty(void) {
    if (g_npk == 0) {
        mdt_free(g_pk);
        g_pk = NULL, g_pk_cap = 0;
    }
}

/* The entry at or before p (-1 if none). */
static int pk_find(const float *p) {
    int lo = 0, hi = g_npk - 1, at = -1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (g_pk[mid].p <= p)
            at = mid, lo = mid + 1;
        else
            hi = mid - 1;
    }
    return at;
}

void mdt_cpu_backend_packed_forget(const float *p) {
    const int i = pk_find(p);
    if (i < 0 || g_pk[i].p != p)
        return;
    memmove(g_pk + i, g_pk + i + 1, sizeof *g_pk * (size_t)(g_npk - i - 1));
    g_npk--;
    pk_release_if_empty();
}

void mdt_cpu_backend_packed_forget_range(const void *lo, int64_t bytes) {
    const char *a = lo, *b = a + bytes;
    int j = 0;
    for (int i = 0; i < g_npk; i++) /* entries are disjoint and sorted: keep those outside */
        if ((const char *)(g_pk[i].p + g_pk[i].floats) <= a || (const char *)g_pk[i].p >= b)
            g_pk[j++] = g_pk[i];
    g_npk = j;
    pk_release_if_empty();
}

mdt_status mdt_cpu_backend_pack(const float *w, float *dst, int64_t N, int64_t K) {
    const int64_t floats = mdt_cpu_gemm_packed_floats(N, K);
    if (floats <= 0)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "[%lld, %lld] weights: not packed on this GEMM path",
                        (long long)N, (long long)K);
    mdt_cpu_backend_packed_forget(dst);
    if (g_npk == g_pk_cap) {
        const int cap = g_pk_cap ? 2 * g_pk_cap : 64;
        packed_w *q = mdt_alloc(sizeof *q * (size_t)cap);
        if (!q)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        if (g_npk)
            memcpy(q, g_pk, sizeof *q * (size_t)g_npk);
        mdt_free(g_pk);
        g_pk = q, g_pk_cap = cap;
    }
    if (mdt_cpu_gemm_pack(w, dst, N, K) != 0)
        return MDT_FAIL(MDT_E_INVALID, "packing [%lld, %lld] weights: %s", (long long)N,
                        (long long)K, mdt_cpu_gemm_error());
    const int at = pk_find(dst) + 1;
    memmove(g_pk + at + 1, g_pk + at, sizeof *g_pk * (size_t)(g_npk - at));
    g_pk[at] = (packed_w){dst, floats, N, K};
    g_npk++;
    return MDT_OK;
}

mdt_status mdt_cpu_backend_unpack(const float *src, float *w, int64_t N, int64_t K) {
    if (mdt_cpu_gemm_unpack(src, w, N, K) != 0)
        return MDT_FAIL(MDT_E_INVALID, "unpacking [%lld, %lld] weights: %s", (long long)N,
                        (long long)K, mdt_cpu_gemm_error());
    return MDT_OK;
}

/* 1: w is packed weights of this shape; 0: plain; -1: inside packed weights but not them. */
static int pk_state(const float *w, int64_t N, int64_t K) {
    const int i = g_npk ? pk_find(w) : -1;
    if (i < 0 || w >= g_pk[i].p + g_pk[i].floats)
        return 0;
    return w == g_pk[i].p && g_pk[i].N == N && g_pk[i].K == K ? 1 : -1;
}

/* The `linear` slot: fp32 weights on the GEMM seam (packed ones on their layout); bf16 weights on
 * the shared rounded input, else through the scratch. */
static void cpu_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                       const float *b, float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (!wh) {
        const int packed = pk_state(w, N, K);
        if (packed > 0) {
            mdt_cpu_gemm_linear_packed(x, ldx, w, b, y, ldy, M, K, N);
        } else if (packed < 0) { /* a caller's bug, reported: no result from a misread layout */
            if (!g_err[0])
                g_err_code = MDT_E_INVALID,
                snprintf(g_err, sizeof g_err,
                         "a [%lld, %lld] linear on part of packed weights (a row view)",
                         (long long)N, (long long)K);
            for (int64_t i = 0; i < M; i++)
                memset(y + i * ldy, 0, sizeof(float) * (size_t)N);
        } else {
            mdt_cpu_gemm_linear_f32(x, ldx, w, b, y, ldy, M, K, N);
        }
        return;
    }
    if (g_sh.x == x && g_sh.ldx == ldx && g_sh.M == M && g_sh.K == K) {
        mdt_cpu_gemm_linear_bf16h(g_sh_h, wh, b, y, ldy, M, K, N); /* x rounded already */
        return;
    }
    if (lin_ws_grow(mdt_cpu_backend_linear_bf16_ws_floats(M, K, N)) != 0) {
        if (!g_err[0])
            g_err_code = MDT_E_NOMEM,
            snprintf(g_err, sizeof g_err,
                     "out of memory for the bf16 widening scratch of a [%lld, %lld] weight",
                     (long long)N, (long long)K);
        return;
    }
    mdt_cpu_backend_linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, g_lin_ws, g_lin_ws_n);
}

static mdt_kernel_ops g_k;            /* the set below with the linear above */
static const mdt_kernel_ops *g_k_set; /* the set g_k was made from */

const mdt_kernel_ops *mdt_cpu_backend_kernels(void) {
    const mdt_kernel_ops *set = mdt_cpu_kernels();
    if (set != g_k_set) {
        g_k = *set;
        g_k.linear = cpu_linear;
        g_k_set = set;
    }
    return &g_k;
}
