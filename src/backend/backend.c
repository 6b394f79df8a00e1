/*
 * backend.c — see backend.h. The CUDA plugin is found and opened here (dlopen), its ABI checked,
 * and its memory functions handed to core (mdt_mem_set_device) so arenas and collectives can use
 * device memory without knowing CUDA.
 */
#define _GNU_SOURCE
#include "backend.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static mdt_backend_kind g_kind = MDT_BACKEND_CPU;
static const mdt_backend_ops *g_ops; /* NULL on the CPU backend */
static int g_bf16;
static mdt_mem_source g_mem, g_pinned;
static char g_first_path[PATH_MAX + 32];

static void *dev_alloc(size_t n) { return g_ops->alloc(n); }
static void dev_free(void *p) { g_ops->free(p); }

/* Path of the plugin: $MESHDIT_CUDA_PLUGIN, else the first libmeshdit_cuda.so found beside the
 * running executable or up to two directories above it (build/tests/gpu/test_gpu finds
 * build/libmeshdit_cuda.so); if none exists, the path beside the executable (for the message). */
static void plugin_path(char *buf, size_t n) {
    const char *env = getenv("MESHDIT_CUDA_PLUGIN");
    char dir[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (env && *env) {
        snprintf(buf, n, "%s", env);
        return;
    }
    snprintf(buf, n, "libmeshdit_cuda.so");
    if (len <= 0)
        return;
    dir[len] = '\0';
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(dir, '/');
        if (!slash)
            break;
        *slash = '\0';
        snprintf(buf, n, "%s/libmeshdit_cuda.so", dir);
        if (access(buf, R_OK) == 0)
            return;
        if (up == 0) /* remembered for the message if nothing is found */
            snprintf(g_first_path, sizeof g_first_path, "%s", buf);
    }
    snprintf(buf, n, "%s", g_first_path);
}

/* The CPU backend's scratch for widening bf16 weight panels (mdt_cpu_linear_bf16), grown by
 * mdt_backend_reserve_linear at load time; a forward that finds it short grows it, and if that
 * fails the failure is kept for mdt_backend_check, like an asynchronous device error. */
static float *g_lin_ws;
static int64_t g_lin_ws_n;
static char g_cpu_err[160];
/* mdt_k_shared_begin's input, rounded to bf16 once (g_sh_h [M, K]) */
static struct {
    const float *x;
    int64_t ldx, M, K;
} g_sh;
static uint16_t *g_sh_h;
static int64_t g_sh_n;
static int g_sh_depth; /* nested begins on the same x */

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

mdt_status mdt_backend_reserve_linear(int64_t K, int64_t N) {
    if (g_ops || !g_bf16)
        return MDT_OK;
    const int64_t need = mdt_cpu_linear_bf16_ws_floats(0, K, N); /* rows: grown by a forward */
    if (lin_ws_grow(need) != 0)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for %lld bytes of bf16 widening scratch",
                        (long long)need * 4);
    return MDT_OK;
}

int64_t mdt_backend_scratch_bytes(void) { return g_lin_ws_n * 4; }

void mdt_backend_release_scratch(void) {
    mdt_free(g_lin_ws);
    g_lin_ws = NULL, g_lin_ws_n = 0;
    mdt_free(g_sh_h);
    g_sh_h = NULL, g_sh_n = 0, g_sh.x = NULL;
    mdt_cpu_gemm_release();
}

mdt_status mdt_backend_select(mdt_backend_kind kind, int ordinal, int bf16) {
    if (kind == MDT_BACKEND_CPU) {
        g_kind = MDT_BACKEND_CPU, g_ops = NULL, g_bf16 = bf16, g_cpu_err[0] = '\0';
        mdt_backend_release_scratch();
        mdt_mem_set_device(NULL);
        return MDT_OK;
    }
    if (g_ops) { /* already started (tests select once per process) */
        g_bf16 = bf16;
        return MDT_OK;
    }
    char path[PATH_MAX + 32], err[512] = "";
    plugin_path(path, sizeof path);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "--device cuda: this build has no CUDA backend (%s; build with nvcc on "
                        "PATH)",
                        dlerror());
    mdt_backend_entry_fn entry;
    *(void **)(&entry) = dlsym(h, MDT_BACKEND_ENTRY);
    const mdt_backend_ops *ops = entry ? entry() : NULL;
    if (!ops || ops->abi != MDT_BACKEND_ABI) {
        dlclose(h);
        return MDT_FAIL(MDT_E_UNSUPPORTED, "--device cuda: %s is not a meshdit %d backend", path,
                        MDT_BACKEND_ABI);
    }
    if (ops->init(ordinal, err, sizeof err) != 0) {
        dlclose(h);
        return MDT_FAIL(MDT_E_UNSUPPORTED, "--device cuda: %s", err);
    }
    g_ops = ops, g_kind = MDT_BACKEND_CUDA, g_bf16 = bf16;
    g_mem = (mdt_mem_source){.alloc = dev_alloc,
                             .free = dev_free,
                             .what = "device",
                             .is_device = ops->is_device,
                             .to_host = ops->to_host,
                             .to_device = ops->to_device,
                             .host_alloc = ops->host_alloc,
                             .host_free = ops->host_free};
    g_pinned = (mdt_mem_source){.alloc = ops->host_alloc, .free = ops->host_free, .what = "pinned"};
    mdt_mem_set_device(&g_mem);
    return MDT_OK; /* the plugin stays loaded for the life of the process */
}

mdt_backend_kind mdt_backend_kind_get(void) { return g_kind; }
const char *mdt_backend_name(void) { return g_ops ? g_ops->name : "cpu"; }
int mdt_backend_bf16(void) { return g_bf16; }
const mdt_backend_ops *mdt_backend_device_ops(void) { return g_ops; }
const mdt_mem_source *mdt_backend_mem(void) { return g_ops ? &g_mem : NULL; }
const mdt_mem_source *mdt_backend_host_mem(void) { return g_ops ? &g_pinned : NULL; }

mdt_status mdt_backend_check(void) {
    char err[512] = "";
    if (g_cpu_err[0]) { /* the message is formatted before the sticky error is cleared */
        const mdt_status st = MDT_FAIL(MDT_E_NOMEM, "%s", g_cpu_err);
        g_cpu_err[0] = '\0';
        return st;
    }
    const char *gemm_err = g_ops ? NULL : mdt_cpu_gemm_error();
    if (gemm_err)
        return MDT_FAIL(MDT_E_INVALID, "CPU GEMM: %s", gemm_err);
    if (g_ops && g_ops->check(err, sizeof err) != 0)
        return MDT_FAIL(MDT_E_INVALID, "device: %s", err);
    return MDT_OK;
}

void mdt_backend_describe(char *buf, size_t n) {
    if (g_ops)
        g_ops->describe(buf, n);
    else
        snprintf(buf, n, "cpu");
}

void *mdt_k_upload(mdt_arena *a, const void *host, size_t bytes) {
    if (!g_ops)
        return (void *)(uintptr_t)host;
    void *d = mdt_arena_floats(a, (int64_t)((bytes + 3) / 4));
    if (d)
        g_ops->to_device(d, host, bytes);
    return d;
}

void mdt_k_to_host(void *host_dst, const void *src, size_t bytes) {
    if (g_ops)
        g_ops->to_host(host_dst, src, bytes);
    else if (host_dst != src)
        memcpy(host_dst, src, bytes);
}

void mdt_k_shared_begin(const float *x, int64_t ldx, int64_t M, int64_t K) {
    if (g_sh_depth > 0 && g_sh.x == x && g_sh.ldx == ldx && g_sh.M == M && g_sh.K == K) {
        g_sh_depth++; /* nested on the same input: already rounded */
        return;
    }
    g_sh.x = NULL, g_sh_depth = 0;
    if (g_ops || !g_bf16 || !mdt_cpu_gemm_bf16_operands() || M <= 0 || K <= 0)
        return;
    if (M * K > g_sh_n) { /* grows on the first forward, then stays */
        uint16_t *p = mdt_alloc(sizeof(uint16_t) * (size_t)(M * K));
        if (!p)
            return; /* the linears round x themselves */
        mdt_free(g_sh_h);
        g_sh_h = p, g_sh_n = M * K;
    }
    mdt_cpu_to_bf16_rows(g_sh_h, K, x, ldx, M, K); // [M, K]
    g_sh.x = x, g_sh.ldx = ldx, g_sh.M = M, g_sh.K = K, g_sh_depth = 1;
}

void mdt_k_shared_end(void) {
    if (g_sh_depth > 0 && --g_sh_depth > 0)
        return;
    g_sh.x = NULL, g_sh_depth = 0;
}

void mdt_k_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh, const float *b,
                  float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (!g_ops && g_bf16 && wh && g_sh.x == x && g_sh.ldx == ldx && g_sh.M == M && g_sh.K == K) {
        mdt_cpu_gemm_linear_bf16h(g_sh_h, wh, b, y, ldy, M, K, N); /* x rounded already */
        return;
    }
    if (!g_ops && g_bf16 && wh) {
        if (lin_ws_grow(mdt_cpu_linear_bf16_ws_floats(M, K, N)) != 0) {
            if (!g_cpu_err[0])
                snprintf(g_cpu_err, sizeof g_cpu_err,
                         "out of memory for the bf16 widening scratch of a [%lld, %lld] weight",
                         (long long)N, (long long)K);
            return;
        }
        mdt_cpu_linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, g_lin_ws, g_lin_ws_n);
        return;
    }
    if (!g_ops) {
        mdt_cpu_linear(x, ldx, w, b, y, ldy, M, K, N);
        return;
    }
    if (M > 0 && N > 0)
        g_ops->linear(x, ldx, g_bf16 ? NULL : w, g_bf16 ? wh : NULL, b, y, ldy, M, K, N);
    mdt_counters_get()->flops[MDT_FLOP_LINEAR] += 2.0 * (double)M * (double)N * (double)K;
}

void mdt_k_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                  int64_t cols) {
    if (rows <= 0 || cols <= 0)
        return;
    if (g_ops)
        g_ops->copy2d(dst, ldd, src, lds, rows, cols);
    else
        mdt_cpu_copy2d(dst, ldd, src, lds, rows, cols);
}

void mdt_k_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                     const int64_t *srow, int64_t n, int64_t w) {
    if (n <= 0 || w <= 0)
        return;
    if (g_ops)
        g_ops->copy_rows(dst, ldd, drow, src, lds, srow, n, w);
    else
        mdt_cpu_copy_rows(dst, ldd, drow, src, lds, srow, n, w);
}

void mdt_k_fill(float *x, int64_t n, float v) {
    if (n <= 0)
        return;
    if (g_ops)
        g_ops->fill(x, n, v);
    else
        mdt_cpu_fill(x, n, v);
}

void mdt_k_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                       const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                       float *sin_t) {
    if (S <= 0 || ncols <= 0)
        return;
    if (g_ops)
        g_ops->angle_table(pos, ldpos, S, ncols, col_axis, col_freq, dbl, cos_t, sin_t);
    else
        mdt_cpu_angle_table(pos, ldpos, S, ncols, col_axis, col_freq, dbl, cos_t, sin_t);
}

void mdt_k_add(float *y, const float *x, int64_t n) {
    if (n <= 0)
        return;
    if (g_ops)
        g_ops->add(y, x, n);
    else
        mdt_cpu_add(y, x, n);
}

void mdt_k_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    if (M <= 0 || N <= 0)
        return;
    if (g_ops)
        g_ops->add_bias(y, ldy, b, M, N);
    else
        mdt_cpu_add_bias(y, ldy, b, M, N);
}

void mdt_k_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                              const float *shift, const float *scale) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->layernorm_modulate(x, y, M, C, eps, shift, scale);
    else
        mdt_cpu_layernorm_modulate(x, y, M, C, eps, shift, scale);
}

void mdt_k_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                         const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                         int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0) {
    if (S <= 0 || H <= 0)
        return;
    if (g_ops)
        g_ops->heads_prepare(src, ld, S, H, D, norm_w, eps, cos_t, sin_t, rot,
                             kind == MDT_ROPE_HALF, dst, Sdst, s0);
    else
        mdt_cpu_heads_prepare(src, ld, S, H, D, norm_w, eps, cos_t, sin_t, rot, kind, dst, Sdst,
                              s0);
}

void mdt_k_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->rmsnorm(x, w, y, M, C, eps);
    else
        mdt_cpu_rmsnorm(x, w, y, M, C, eps);
}

void mdt_k_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                         const int64_t *idx, int64_t shift_off, int64_t scale_off) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->modulate_rows(y, M, C, table, ld, idx, shift_off, scale_off);
    else
        mdt_cpu_modulate_rows(y, M, C, table, ld, idx, shift_off, scale_off);
}

void mdt_k_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table, int64_t ld,
                              const int64_t *idx, int64_t gate_off, int64_t M, int64_t C) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->gate_residual_rows(x, y, ldy, table, ld, idx, gate_off, M, C);
    else
        mdt_cpu_gate_residual_rows(x, y, ldy, table, ld, idx, gate_off, M, C);
}

void mdt_k_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                         int64_t C) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->gate_residual(x, y, ldy, gate, M, C);
    else
        mdt_cpu_gate_residual(x, y, ldy, gate, M, C);
}

void mdt_k_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->swiglu(in, out, M, n);
    else
        mdt_cpu_swiglu(in, out, M, n);
}

void mdt_k_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    if (M <= 0)
        return;
    if (g_ops)
        g_ops->gelu_rows(x, ld, M, n);
    else
        mdt_cpu_gelu_rows(x, ld, M, n);
}

void mdt_k_silu(float *x, int64_t n) {
    if (n <= 0)
        return;
    if (g_ops)
        g_ops->silu(x, n);
    else
        mdt_cpu_silu(x, n);
}

mdt_status mdt_k_attention(mdt_arena *ar, const float *q, const float *k, const float *v,
                           float *out, int64_t ld_out, float *lse, int64_t H, int64_t Sq,
                           int64_t Sk, int64_t sk_valid, int64_t D, float scale) {
    if (g_ops) {
        if (H > 0 && Sq > 0)
            g_ops->attention(q, k, v, out, ld_out, lse, H, Sq, Sk, sk_valid, D, scale, g_bf16);
        mdt_counters *c = mdt_counters_get();
        c->flops[MDT_FLOP_ATTN] += 4.0 * (double)H * (double)Sq * (double)sk_valid * (double)D;
        c->attn_calls++;
        return MDT_OK;
    }
    mdt_arena_mark mk = mdt_arena_mark_get(ar);
    float *ws = mdt_arena_floats(ar, mdt_cpu_attention_ws_floats(Sk, D, g_bf16));
    if (!ws)
        return MDT_E_NOMEM;
    mdt_cpu_attention(q, k, v, out, ld_out, lse, H, Sq, Sk, sk_valid, D, scale, g_bf16, ws);
    mdt_arena_rewind(ar, mk);
    return MDT_OK;
}

void mdt_k_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo, const float *l,
                     int64_t hn, int64_t L, int64_t D) {
    if (hn <= 0 || L <= 0)
        return;
    if (g_ops)
        g_ops->lse_merge(O, ldO, Lr, o, ldo, l, hn, L, D);
    else
        mdt_cpu_lse_merge(O, ldO, Lr, o, ldo, l, hn, L, D);
}
