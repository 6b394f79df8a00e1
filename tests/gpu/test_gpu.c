/*
 * test_gpu.c — every op of the CUDA backend against the CPU kernels (themselves held to
 * kernels/ref by test_kernels) on fresh random inputs, outputs poisoned with NaN first so an
 * unwritten element fails: f32 ops within 1e-4 relative, bf16 GEMM and attention within 2e-2.
 * Then NCCL on a one-rank communicator (all-reduce, all-to-all, ring send/recv to itself), and,
 * with `bench`, the attention and GEMM rates at a Flux single-block shape.
 *
 * Needs a GPU: run by scripts/gpu-check, never by `make test`. Exits 1 on any failure, 77 when
 * the CUDA backend cannot start (no GPU, no plugin).
 */
#define _POSIX_C_SOURCE 200809L
#include "backend/backend.h"
#include "harness.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/ref/ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const mdt_device_ops *g;   /* the device's memory */
static const mdt_kernel_ops *gk;  /* its kernels (no counting: the front's job) */
static const mdt_device_comm *gc; /* its collectives (NCCL), or NULL */
static const mdt_kernel_ops *hk;  /* the CPU kernel set: the reference on the host */
static uint64_t g_seed = 12345;

static float frand(void) { /* xorshift, [-1, 1) */
    g_seed ^= g_seed << 13, g_seed ^= g_seed >> 7, g_seed ^= g_seed << 17;
    return (float)((g_seed >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static float *hrand(int64_t n, float scale) {
    float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        p[i] = frand() * scale;
    return p;
}

static void *dev_copy(const void *h, size_t bytes) {
    void *d = g->alloc(bytes ? bytes : 4);
    if (bytes)
        g->to_device(d, h, bytes);
    return d;
}

static float *dev_f(const float *h, int64_t n) { return dev_copy(h, sizeof(float) * (size_t)n); }

/* A device buffer of n floats filled with NaN (an element the op does not write stays NaN). */
static float *dev_poison(int64_t n) {
    float *d = g->alloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    gk->fill(d, n, NAN);
    return d;
}

static float *back(const float *d, int64_t n) {
    float *h = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    g->to_host(h, d, sizeof(float) * (size_t)n);
    return h;
}

static void expect_close(const char *what, const float *got, const float *want, int64_t n,
                         double tol) {
    const double e = t_rel_err(got, want, (long)n, 1e-30);
    EXPECT(e <= tol, "%s: relative error %.3e > %.1e", what, e, tol);
    printf("  %-44s rel err %.2e (tol %.0e)\n", what, e, tol);
}

static void check_device(void) {
    char err[512] = "";
    EXPECT(g->check(err, sizeof err) == 0, "device error: %s", err);
}

static void test_linear(void) {
    const int64_t M = 77, K = 96, N = 130, ldx = 100, ldy = 140;
    float *x = hrand(M * ldx, 1), *w = hrand(N * K, 0.1f), *b = hrand(N, 0.1f);
    float *y = hrand(M * ldy, 1); /* columns past N must survive */
    float *want = malloc(sizeof(float) * (size_t)(M * ldy));
    memcpy(want, y, sizeof(float) * (size_t)(M * ldy));
    hk->linear(x, ldx, w, NULL, b, want, ldy, M, K, N);
    float *dx = dev_f(x, M * ldx), *dw = dev_f(w, N * K), *db = dev_f(b, N);
    float *dy = dev_f(y, M * ldy);
    for (int64_t i = 0; i < M; i++) /* poison only the columns the GEMM writes */
        gk->fill(dy + i * ldy, N, NAN);
    gk->linear(dx, ldx, dw, NULL, db, dy, ldy, M, K, N);
    float *got = back(dy, M * ldy);
    expect_close("linear f32 (strided, bias)", got, want, M * ldy, 1e-4);
    free(got);
    uint16_t *dwh = g->alloc(2 * (size_t)(N * K));
    g->to_bf16(dwh, dw, N * K);
    for (int64_t i = 0; i < M; i++)
        gk->fill(dy + i * ldy, N, NAN);
    gk->linear(dx, ldx, NULL, dwh, db, dy, ldy, M, K, N);
    got = back(dy, M * ldy);
    expect_close("linear bf16 weights, fp32 accumulation", got, want, M * ldy, 2e-2);
    free(got), free(x), free(w), free(b), free(y), free(want);
    g->free(dx), g->free(dw), g->free(db), g->free(dy), g->free(dwh);
    check_device();
}

static void test_norms(void) {
    const int64_t M = 37, C = 300;
    float *x = hrand(M * C, 2), *sh = hrand(C, 0.5f), *sc = hrand(C, 0.5f), *w = hrand(C, 1);
    float *want = malloc(sizeof(float) * (size_t)(M * C));
    float *dx = dev_f(x, M * C), *dsh = dev_f(sh, C), *dsc = dev_f(sc, C), *dw = dev_f(w, C);
    float *dy = dev_poison(M * C);
    for (int mod = 0; mod < 2; mod++) {
        hk->layernorm_modulate(x, want, M, C, 1e-6f, mod ? sh : NULL, mod ? sc : NULL);
        gk->fill(dy, M * C, NAN);
        gk->layernorm_modulate(dx, dy, M, C, 1e-6f, mod ? dsh : NULL, mod ? dsc : NULL);
        float *got = back(dy, M * C);
        expect_close(mod ? "layernorm + modulate" : "layernorm", got, want, M * C, 1e-4);
        free(got);
        hk->rmsnorm(x, mod ? w : NULL, want, M, C, 1e-5f);
        gk->fill(dy, M * C, NAN);
        gk->rmsnorm(dx, mod ? dw : NULL, dy, M, C, 1e-5f);
        got = back(dy, M * C);
        expect_close(mod ? "rmsnorm (weight)" : "rmsnorm", got, want, M * C, 1e-4);
        free(got);
    }
    free(x), free(sh), free(sc), free(w), free(want);
    g->free(dx), g->free(dsh), g->free(dsc), g->free(dw), g->free(dy);
    check_device();
}

static void test_heads(void) {
    const int64_t S = 19, H = 3, Sdst = 30, s0 = 7;
    const struct {
        int64_t D, rot;
        mdt_rope_kind kind;
        int norm;
        const char *name;
    } cs[] = {{128, 128, MDT_ROPE_INTERLEAVED, 1, "heads_prepare rmsnorm + interleaved rope"},
              {64, 48, MDT_ROPE_HALF, 0, "heads_prepare rotate-half rope (48 of 64)"},
              {16, 16, MDT_ROPE_INTERLEAVED, 0, "heads_prepare no norm, no rope"}};
    for (int c = 0; c < 3; c++) {
        const int64_t D = cs[c].D, rot = cs[c].rot, ld = H * D + 5;
        float *src = hrand(S * ld, 2), *nw = hrand(D, 1), *ct = hrand(S * rot, 1),
              *st = hrand(S * rot, 1);
        float *want = malloc(sizeof(float) * (size_t)(H * Sdst * D));
        for (int64_t i = 0; i < H * Sdst * D; i++)
            want[i] = NAN;
        const int rope = c < 2;
        hk->heads_prepare(src, ld, S, H, D, cs[c].norm ? nw : NULL, 1e-6f, rope ? ct : NULL,
                          rope ? st : NULL, rot, cs[c].kind, want, Sdst, s0);
        float *dsrc = dev_f(src, S * ld), *dnw = dev_f(nw, D), *dct = dev_f(ct, S * rot),
              *dst_ = dev_f(st, S * rot), *dd = dev_poison(H * Sdst * D);
        gk->heads_prepare(dsrc, ld, S, H, D, cs[c].norm ? dnw : NULL, 1e-6f, rope ? dct : NULL,
                          rope ? dst_ : NULL, rot, cs[c].kind, dd, Sdst, s0);
        float *got = back(dd, H * Sdst * D);
        /* rows outside [s0, s0 + S) are NaN in both: compare the written rows */
        float *gw = malloc(sizeof(float) * (size_t)(H * S * D)),
              *ww = malloc(sizeof(float) * (size_t)(H * S * D));
        for (int64_t h = 0; h < H; h++) {
            memcpy(gw + h * S * D, got + (h * Sdst + s0) * D, sizeof(float) * (size_t)(S * D));
            memcpy(ww + h * S * D, want + (h * Sdst + s0) * D, sizeof(float) * (size_t)(S * D));
        }
        expect_close(cs[c].name, gw, ww, H * S * D, 1e-4);
        free(src), free(nw), free(ct), free(st), free(want), free(got), free(gw), free(ww);
        g->free(dsrc), g->free(dnw), g->free(dct), g->free(dst_), g->free(dd);
    }
    check_device();
}

static void test_elementwise(void) {
    const int64_t M = 41, C = 257, ld = 300, rows_t = 5;
    float *x = hrand(M * C, 2), *y = hrand(M * ld, 2), *tab = hrand(rows_t * 3 * C, 0.5f);
    float *gate = hrand(C, 1);
    int64_t idx[41];
    for (int64_t i = 0; i < M; i++)
        idx[i] = (i * 7) % rows_t;
    float *want = malloc(sizeof(float) * (size_t)(M * ld * 2));
    float *dx = dev_f(x, M * C), *dy = dev_f(y, M * ld), *dt = dev_f(tab, rows_t * 3 * C);
    float *dg = dev_f(gate, C);
    int64_t *di = dev_copy(idx, sizeof idx);
    float *got;
    /* modulate_rows */
    memcpy(want, x, sizeof(float) * (size_t)(M * C));
    hk->modulate_rows(want, M, C, tab, 3 * C, idx, C, 2 * C);
    gk->modulate_rows(dx, M, C, dt, 3 * C, di, C, 2 * C);
    got = back(dx, M * C);
    expect_close("modulate_rows", got, want, M * C, 1e-5);
    free(got);
    /* gate_residual_rows (x is now the modulated one on both sides) */
    hk->gate_residual_rows(want, y, ld, tab, 3 * C, idx, 0, M, C);
    gk->gate_residual_rows(dx, dy, ld, dt, 3 * C, di, 0, M, C);
    got = back(dx, M * C);
    expect_close("gate_residual_rows", got, want, M * C, 1e-5);
    free(got);
    hk->gate_residual(want, y, ld, gate, M, C);
    gk->gate_residual(dx, dy, ld, dg, M, C);
    got = back(dx, M * C);
    expect_close("gate_residual", got, want, M * C, 1e-5);
    free(got);
    /* gelu on a strided block, silu, add, add_bias */
    memcpy(want, y, sizeof(float) * (size_t)(M * ld));
    hk->gelu_rows(want + 3, ld, M, C);
    gk->gelu_rows(dy + 3, ld, M, C);
    got = back(dy, M * ld);
    expect_close("gelu_rows (strided, tanh)", got, want, M * ld, 1e-5);
    free(got);
    hk->silu(want, M * ld);
    gk->silu(dy, M * ld);
    got = back(dy, M * ld);
    expect_close("silu", got, want, M * ld, 1e-5);
    free(got);
    hk->add_bias(want, ld, gate, M, C);
    gk->add_bias(dy, ld, dg, M, C);
    hk->add(want, y, M * C);
    float *dy0 = dev_f(y, M * C);
    gk->add(dy, dy0, M * C);
    got = back(dy, M * ld);
    expect_close("add_bias + add", got, want, M * ld, 1e-5);
    free(got);
    /* swiglu: in [M, 2n] */
    const int64_t n = 128;
    float *in = hrand(M * 2 * n, 3), *din = dev_f(in, M * 2 * n), *dout = dev_poison(M * n);
    hk->swiglu(in, want, M, n);
    gk->swiglu(din, dout, M, n);
    got = back(dout, M * n);
    expect_close("swiglu", got, want, M * n, 1e-5);
    free(got);
    /* copies */
    float *dc = dev_poison(M * ld);
    gk->copy2d(dc, ld, dx, C, M, C);
    float *cx = back(dx, M * C);
    got = back(dc, M * ld);
    hk->copy2d(want, C, got, ld, M, C);
    expect_close("copy2d", want, cx, M * C, 0);
    free(got);
    int64_t perm[41];
    for (int64_t i = 0; i < M; i++)
        perm[i] = (i * 17 + 3) % M;
    int64_t *dp = dev_copy(perm, sizeof perm);
    gk->copy_rows(dc, ld, dp, dx, C, NULL, M, C); /* scatter */
    float *dc2 = dev_poison(M * C);
    gk->copy_rows(dc2, C, NULL, dc, ld, dp, M, C); /* gather back */
    got = back(dc2, M * C);
    expect_close("copy_rows scatter then gather", got, cx, M * C, 0);
    free(got), free(cx);
    free(x), free(y), free(tab), free(gate), free(want), free(in);
    g->free(dx), g->free(dy), g->free(dt), g->free(dg), g->free(di), g->free(dy0), g->free(din);
    g->free(dout), g->free(dc), g->free(dp), g->free(dc2);
    check_device();
}

static void test_attention(void) {
    const int64_t H = 3, Sq = 77, Sk = 150;
    const struct {
        int64_t D, skv;
        int bf16;
        double tol;
    } cs[] = {{16, 150, 0, 1e-4},  {64, 120, 0, 1e-4}, {128, 101, 0, 1e-4}, {64, 150, 1, 2e-2},
              {128, 101, 1, 2e-2}, {128, 0, 1, 0},     {64, 0, 0, 0}};
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        const int64_t D = cs[c].D, skv = cs[c].skv, ld = H * D + 8;
        const float scale = 1.0f / sqrtf((float)D);
        float *q = hrand(H * Sq * D, 2), *k = hrand(H * Sk * D, 2), *v = hrand(H * Sk * D, 1);
        float *want = malloc(sizeof(float) * (size_t)(Sq * ld)), *wl = hrand(H * Sq, 1);
        float *ws = malloc(sizeof(float) * (size_t)hk->attention_ws_floats(Sk, D, 0));
        for (int64_t i = 0; i < Sq * ld; i++)
            want[i] = 0.0f;
        hk->attention(q, k, v, want, ld, wl, H, Sq, Sk, skv, D, scale, 0, ws);
        float *dq = dev_f(q, H * Sq * D), *dk = dev_f(k, H * Sk * D), *dv = dev_f(v, H * Sk * D);
        float *dout = dev_poison(Sq * ld), *dl = dev_poison(H * Sq);
        gk->fill(dout, Sq * ld, 0.0f); /* the padding columns are not the kernel's */
        for (int64_t i = 0; i < Sq; i++)
            gk->fill(dout + i * ld, H * D, NAN);
        gk->attention(dq, dk, dv, dout, ld, dl, H, Sq, Sk, skv, D, scale, cs[c].bf16, NULL);
        float *got = back(dout, Sq * ld), *gl = back(dl, H * Sq);
        char name[128];
        snprintf(name, sizeof name, "attention %s D=%lld, %lld of %lld keys",
                 cs[c].bf16 == 2 ? "bf16 wmma"
                 : cs[c].bf16    ? "bf16 mma.sync"
                                 : "f32",
                 (long long)D, (long long)skv, (long long)Sk);
        if (skv == 0) {
            int ok = 1;
            for (int64_t i = 0; i < Sq * ld; i++)
                ok &= got[i] == 0.0f;
            for (int64_t i = 0; i < H * Sq; i++)
                ok &= gl[i] == -INFINITY;
            EXPECT(ok, "%s: no valid keys must give zeros and lse = -inf", name);
            printf("  %-44s zeros, lse -inf: %s\n", name, ok ? "ok" : "WRONG");
        } else {
            expect_close(name, got, want, Sq * ld, cs[c].tol);
            double md = 0;
            for (int64_t i = 0; i < H * Sq; i++)
                md = fmax(md, fabs((double)gl[i] - wl[i]));
            EXPECT(md <= (cs[c].bf16 ? 2e-2 : 1e-4) * 10, "%s: lse differs by %.3e", name, md);
        }
        free(q), free(k), free(v), free(want), free(wl), free(ws), free(got), free(gl);
        g->free(dq), g->free(dk), g->free(dv), g->free(dout), g->free(dl);
    }
    /* log-sum-exp merge */
    const int64_t hn = 3, L = 50, D = 64, ldO = hn * D + 4;
    float *O = hrand(L * ldO, 1), *o = hrand(L * hn * D, 1), *Lr = hrand(hn * L, 3),
          *l = hrand(hn * L, 3);
    Lr[0] = -INFINITY, l[1] = -INFINITY, Lr[2] = l[2] = -INFINITY;
    float *dO = dev_f(O, L * ldO), *dLr = dev_f(Lr, hn * L), *dob = dev_f(o, L * hn * D),
          *dl = dev_f(l, hn * L);
    hk->lse_merge(O, ldO, Lr, o, hn * D, l, hn, L, D);
    gk->lse_merge(dO, ldO, dLr, dob, hn * D, dl, hn, L, D);
    float *gO = back(dO, L * ldO), *gL = back(dLr, hn * L);
    expect_close("lse_merge output", gO, O, L * ldO, 1e-5);
    int same_inf = 1;
    for (int64_t i = 0; i < hn * L; i++)
        same_inf &= isinf(gL[i]) == isinf(Lr[i]) && (isinf(Lr[i]) || fabsf(gL[i] - Lr[i]) < 1e-4f);
    EXPECT(same_inf, "lse_merge: running log-sum-exp differs");
    free(O), free(o), free(Lr), free(l), free(gO), free(gL);
    g->free(dO), g->free(dLr), g->free(dob), g->free(dl);
    check_device();
}

static void test_nccl(void) {
    unsigned char id[128];
    char err[256] = "";
    if (!gc || gc->comm_id(id) != 0) {
        printf("  NCCL: not available (libnccl.so.2 not loadable): skipped\n");
        return;
    }
    void *c = gc->comm_init(1, id, 0, err, sizeof err);
    EXPECT(c != NULL, "NCCL one-rank communicator: %s", err);
    if (!c)
        return;
    const int64_t n = 1000;
    float *x = hrand(n, 1), *dx = dev_f(x, n), *dy = dev_poison(n);
    EXPECT(gc->comm_allreduce(c, dx, n, 1) == 0, "NCCL all-reduce");
    float *got = back(dx, n);
    expect_close("NCCL all-reduce (1 rank: identity)", got, x, n, 0);
    free(got);
    int64_t cnt[1] = {n}, dsp[1] = {0};
    EXPECT(gc->comm_alltoallv(c, 1, dx, cnt, dsp, dy, cnt, dsp) == 0, "NCCL all-to-all");
    got = back(dy, n);
    expect_close("NCCL all-to-all to itself", got, x, n, 0);
    free(got);
    gk->fill(dy, n, NAN);
    EXPECT(gc->comm_sendrecv(c, dx, 0, dy, 0, n) == 0 && gc->comm_wait(c) == 0, "NCCL send/recv");
    got = back(dy, n);
    expect_close("NCCL ring send/recv to itself", got, x, n, 0);
    free(got), free(x);
    g->free(dx), g->free(dy);
    gc->comm_free(c);
    check_device();
}

static void bench(void) {
    /* a Flux single block: 24 heads of 128, 4096 image + 512 text tokens */
    const int64_t H = 24, S = 4608, D = 128, C = H * D, M = S;
    float *dq = dev_poison(H * S * D), *dk = dev_poison(H * S * D), *dv = dev_poison(H * S * D);
    float *h = hrand(H * S * D, 1);
    g->to_device(dq, h, sizeof(float) * (size_t)(H * S * D));
    g->to_device(dk, h, sizeof(float) * (size_t)(H * S * D));
    g->to_device(dv, h, sizeof(float) * (size_t)(H * S * D));
    float *dout = dev_poison(S * C);
    char err[256];
    for (int bf = 1; bf <= 3; bf++) { /* 1 mma.sync, 2 wmma, 3 -> 0: f32 */
        const int reps = bf == 1 ? 20 : 3, kind = bf == 3 ? 0 : bf;
        gk->attention(dq, dk, dv, dout, C, NULL, H, S, S, S, D, 0.088f, kind, NULL);
        g->check(err, sizeof err);
        double t0 = mdt_now();
        for (int r = 0; r < reps; r++)
            gk->attention(dq, dk, dv, dout, C, NULL, H, S, S, S, D, 0.088f, kind, NULL);
        g->check(err, sizeof err);
        const double t = (mdt_now() - t0) / reps, fl = 4.0 * H * S * S * D;
        printf("bench attention %s H=%lld S=%lld D=%lld: %.3f ms, %.1f TFLOP/s\n",
               kind == 1   ? "bf16 mma.sync"
               : kind == 2 ? "bf16 wmma"
                           : "f32",
               (long long)H, (long long)S, (long long)D, t * 1e3, fl / t * 1e-12);
    }
    /* the block's largest GEMM: proj_out [S, 5C] x [C, 5C]^T in bf16 and f32 */
    const int64_t K = 5 * C;
    float *dx = dev_poison(M * K), *dw = dev_poison(C * K), *dy = dev_poison(M * C);
    gk->fill(dx, M * K, 0.01f), gk->fill(dw, C * K, 0.02f);
    uint16_t *dwh = g->alloc(2 * (size_t)(C * K));
    g->to_bf16(dwh, dw, C * K);
    for (int bf = 1; bf >= 0; bf--) {
        const int reps = 10;
        gk->linear(dx, K, bf ? NULL : dw, bf ? dwh : NULL, NULL, dy, C, M, K, C);
        g->check(err, sizeof err);
        double t0 = mdt_now();
        for (int r = 0; r < reps; r++)
            gk->linear(dx, K, bf ? NULL : dw, bf ? dwh : NULL, NULL, dy, C, M, K, C);
        g->check(err, sizeof err);
        const double t = (mdt_now() - t0) / reps, fl = 2.0 * M * K * C;
        printf("bench linear %s M=%lld K=%lld N=%lld: %.3f ms, %.1f TFLOP/s\n",
               bf ? "bf16" : "f32 ", (long long)M, (long long)K, (long long)C, t * 1e3,
               fl / t * 1e-12);
    }
    free(h);
    g->free(dq), g->free(dk), g->free(dv), g->free(dout), g->free(dx), g->free(dw), g->free(dy);
    g->free(dwh);
    check_device();
}

int main(int argc, char **argv) {
    mdt_status st = mdt_backend_select(MDT_BACKEND_CUDA, 0, 0);
    if (st != MDT_OK) {
        printf("test_gpu: skipped: %s\n", mdt_last_error());
        return 77;
    }
    g = mdt_backend_device_ops(), gk = mdt_backend_kernels(), gc = mdt_backend_device_comm();
    hk = mdt_cpu_kernels();
    char desc[256];
    mdt_backend_describe(desc, sizeof desc);
    printf("test_gpu on %s\n", desc);
    if (argc > 1 && strcmp(argv[1], "bench") == 0) {
        bench();
        TEST_END();
    }
    test_linear();
    test_norms();
    test_heads();
    test_elementwise();
    test_attention();
    test_nccl();
    TEST_END();
}
