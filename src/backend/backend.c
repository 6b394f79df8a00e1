/*
 * backend.c — see backend.h. The CUDA plugin is found and opened here (dlopen), its ABI checked,
 * and its memory functions handed to core (mdt_mem_set_device) so arenas and collectives can use
 * device memory without knowing CUDA. The front table (mdt_k) is here too: the one place where
 * empty work is skipped and FLOPs are counted, for every device.
 */
#define _GNU_SOURCE
#include "backend.h"
#include "cpu_backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static mdt_backend_kind g_kind = MDT_BACKEND_CPU;
static const mdt_device_ops *g_ops;    /* NULL on the CPU backend */
static const mdt_kernel_ops *g_kern;   /* the device's kernels (NULL: the CPU backend's) */
static const mdt_device_comm *g_dcomm; /* the device's collectives, if any */
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

mdt_status mdt_backend_reserve_linear(int64_t K, int64_t N) {
    return g_ops ? MDT_OK : mdt_cpu_backend_reserve_linear(K, N);
}

int64_t mdt_backend_scratch_bytes(void) { return mdt_cpu_backend_scratch_bytes(); }

void mdt_backend_release_scratch(void) { mdt_cpu_backend_release(); }

int64_t mdt_backend_packed_floats(int64_t N, int64_t K) {
    return g_ops ? 0 : mdt_cpu_backend_packed_floats(N, K);
}

mdt_status mdt_backend_pack(const float *w, float *dst, int64_t N, int64_t K) {
    return mdt_cpu_backend_pack(w, dst, N, K);
}

mdt_status mdt_backend_unpack(const float *src, float *w, int64_t N, int64_t K) {
    return mdt_cpu_backend_unpack(src, w, N, K);
}

void mdt_backend_packed_forget(const float *p) { mdt_cpu_backend_packed_forget(p); }

void mdt_backend_packed_forget_range(const void *lo, int64_t bytes) {
    mdt_cpu_backend_packed_forget_range(lo, bytes);
}

mdt_status mdt_backend_select(mdt_backend_kind kind, int ordinal, int bf16) {
    if (kind == MDT_BACKEND_CPU) {
        const char *pack = getenv("MESHDIT_CPU_PACK");
        if (pack && *pack && strcmp(pack, "auto") != 0 && strcmp(pack, "off") != 0)
            return MDT_FAIL(MDT_E_INVALID, "MESHDIT_CPU_PACK='%s': auto (the default) or off",
                            pack);
        mdt_cpu_backend_set_pack(!(pack && strcmp(pack, "off") == 0));
        g_kind = MDT_BACKEND_CPU, g_ops = NULL, g_kern = NULL, g_dcomm = NULL, g_bf16 = bf16;
        mdt_cpu_backend_start(bf16);
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
                        "--device cuda: this build has no CUDA backend (%s; `make` builds the "
                        "plugin, libmeshdit_cuda.so, when nvcc is on PATH)",
                        dlerror());
    mdt_backend_entry_fn entry;
    *(void **)(&entry) = dlsym(h, MDT_BACKEND_ENTRY);
    const mdt_backend_plugin *pl = entry ? entry() : NULL;
    if (!pl || pl->abi != MDT_BACKEND_ABI || !pl->dev || !pl->kernels) {
        dlclose(h);
        return MDT_FAIL(MDT_E_UNSUPPORTED, "--device cuda: %s is not a meshdit %d backend", path,
                        MDT_BACKEND_ABI);
    }
    const mdt_device_ops *ops = pl->dev;
    if (ops->init(ordinal, err, sizeof err) != 0) {
        dlclose(h);
        return MDT_FAIL(MDT_E_UNSUPPORTED, "--device cuda: %s", err);
    }
    mdt_device_comm_entry_fn comm_entry;
    *(void **)(&comm_entry) = dlsym(h, MDT_DEVICE_COMM_ENTRY);
    const mdt_device_comm *dc = comm_entry ? comm_entry() : NULL;
    g_dcomm = dc && dc->abi == MDT_DEVICE_COMM_ABI ? dc : NULL;
    g_ops = ops, g_kern = pl->kernels, g_kind = MDT_BACKEND_CUDA, g_bf16 = bf16;
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
const char *mdt_backend_name(void) { return g_kern ? g_kern->name : "cpu"; }
int mdt_backend_bf16(void) { return g_bf16; }
const mdt_device_ops *mdt_backend_device_ops(void) { return g_ops; }
const mdt_device_comm *mdt_backend_device_comm(void) { return g_dcomm; }
const mdt_kernel_ops *mdt_backend_kernels(void) {
    return g_kern ? g_kern : mdt_cpu_backend_kernels();
}
const mdt_mem_source *mdt_backend_mem(void) { return g_ops ? &g_mem : NULL; }
const mdt_mem_source *mdt_backend_host_mem(void) { return g_ops ? &g_pinned : NULL; }

mdt_status mdt_backend_check(void) {
    char err[512] = "";
    if (!g_ops)
        return mdt_cpu_backend_check();
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

mdt_status mdt_cpu_kernels_select(const char *isa, const char *gemm) {
    if (isa && *isa)
        MDT_TRY(mdt_cpu_isa_select(isa));
    if (gemm && *gemm)
        MDT_TRY(mdt_cpu_gemm_select(gemm));
    return MDT_OK;
}

mdt_status mdt_backend_measure_bf16(int *operands, double *t_ops, double *t_widen, int *asked) {
    *operands = 0, *t_ops = *t_widen = 0, *asked = 0;
    if (g_ops || !g_bf16)
        return MDT_OK;
    return mdt_cpu_backend_measure_bf16(operands, t_ops, t_widen, asked);
}

void mdt_backend_set_bf16_operands(int operands, const char *why) {
    if (!g_ops && g_bf16)
        mdt_cpu_gemm_set_bf16_operands(operands, why);
}

void mdt_device_info_get(mdt_device_info *out) {
    memset(out, 0, sizeof *out);
    out->backend = mdt_backend_name();
    out->gpu = g_ops != NULL;
    if (g_ops) {
        mdt_backend_describe(out->description, sizeof out->description);
        out->device_mem_peak = g_ops->mem_peak();
    }
    out->bf16 = g_bf16;
    out->bf16_operands = out->bf16 && mdt_cpu_gemm_bf16_operands();
    out->bf16_why = out->bf16 && !g_ops ? mdt_cpu_gemm_bf16_why() : "";
    out->cpu_kernels = mdt_cpu_isa();
    mdt_cpu_gemm_describe(out->cpu_gemm, sizeof out->cpu_gemm);
    out->scratch_bytes = mdt_backend_scratch_bytes();
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
    if (!g_ops)
        mdt_cpu_backend_shared_begin(x, ldx, M, K);
}

void mdt_k_shared_end(void) {
    if (!g_ops)
        mdt_cpu_backend_shared_end();
}

/* ---- the front table: skip empty work, count, forward to the device ---- */

static const mdt_kernel_ops *dev(void) { return g_kern ? g_kern : mdt_cpu_backend_kernels(); }

/* FLOPs of one call of `kind` and its seconds since t0 (host wall time: on a device whose kernels
 * run asynchronously this is the launch, not the kernel; mdt_counters.seconds says so) */
static void count(mdt_flop_kind kind, double flops, double t0) {
    mdt_counters *c = mdt_counters_get();
    c->flops[kind] += flops;
    c->seconds[kind] += mdt_now() - t0;
}

static void f_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                     int64_t cols) {
    if (rows > 0 && cols > 0) {
        const double t0 = mdt_now();
        dev()->copy2d(dst, ldd, src, lds, rows, cols);
        count(MDT_FLOP_OTHER, 0, t0);
    }
}

static void f_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                        const int64_t *srow, int64_t n, int64_t w) {
    if (n > 0 && w > 0) {
        const double t0 = mdt_now();
        dev()->copy_rows(dst, ldd, drow, src, lds, srow, n, w);
        count(MDT_FLOP_OTHER, 0, t0);
    }
}

static void f_fill(float *x, int64_t n, float v) {
    if (n > 0) {
        const double t0 = mdt_now();
        dev()->fill(x, n, v);
        count(MDT_FLOP_OTHER, 0, t0);
    }
}

static void f_add(float *y, const float *x, int64_t n) {
    if (n > 0) {
        const double t0 = mdt_now();
        dev()->add(y, x, n);
        count(MDT_FLOP_OTHER, 0, t0);
    }
}

static void f_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    if (M > 0 && N > 0) {
        const double t0 = mdt_now();
        dev()->add_bias(y, ldy, b, M, N);
        count(MDT_FLOP_OTHER, 0, t0);
    }
}

static void f_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                          const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                          float *sin_t) {
    if (S > 0 && ncols > 0) {
        const double t0 = mdt_now();
        dev()->angle_table(pos, ldpos, S, ncols, col_axis, col_freq, dbl, cos_t, sin_t);
        count(MDT_FLOP_OTHER, 0, t0);
    }
}

static void f_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                     const float *b, float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (M <= 0 || N <= 0)
        return;
    wh = g_bf16 ? wh : NULL; /* bf16 weights only when selected; then w is not used */
    const double t0 = mdt_now();
    dev()->linear(x, ldx, wh ? NULL : w, wh, b, y, ldy, M, K, N);
    count(MDT_FLOP_LINEAR, 2.0 * (double)M * (double)N * (double)K, t0);
}

static void f_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                                 const float *shift, const float *scale) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->layernorm_modulate(x, y, M, C, eps, shift, scale);
    count(MDT_FLOP_OTHER, 8.0 * (double)M * (double)C, t0);
}

static void f_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                            const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                            int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0) {
    if (S <= 0 || H <= 0)
        return;
    const double t0 = mdt_now();
    dev()->heads_prepare(src, ld, S, H, D, norm_w, eps, cos_t, sin_t, rot, kind, dst, Sdst, s0);
    count(MDT_FLOP_OTHER, 8.0 * (double)S * (double)H * (double)D, t0);
}

static void f_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->rmsnorm(x, w, y, M, C, eps);
    count(MDT_FLOP_OTHER, 4.0 * (double)M * (double)C, t0);
}

static void f_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                            const int64_t *idx, int64_t shift_off, int64_t scale_off) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->modulate_rows(y, M, C, table, ld, idx, shift_off, scale_off);
    count(MDT_FLOP_OTHER, 3.0 * (double)M * (double)C, t0);
}

static void f_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table,
                                 int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                                 int64_t C) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->gate_residual_rows(x, y, ldy, table, ld, idx, gate_off, M, C);
    count(MDT_FLOP_OTHER, 2.0 * (double)M * (double)C, t0);
}

static void f_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                            int64_t C) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->gate_residual(x, y, ldy, gate, M, C);
    count(MDT_FLOP_OTHER, 2.0 * (double)M * (double)C, t0);
}

static void f_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->swiglu(in, out, M, n);
    count(MDT_FLOP_OTHER, 6.0 * (double)M * (double)n, t0);
}

static void f_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    if (M <= 0)
        return;
    const double t0 = mdt_now();
    dev()->gelu_rows(x, ld, M, n);
    count(MDT_FLOP_OTHER, 10.0 * (double)M * (double)n, t0);
}

static void f_silu(float *x, int64_t n) {
    if (n <= 0)
        return;
    const double t0 = mdt_now();
    dev()->silu(x, n);
    count(MDT_FLOP_OTHER, 5.0 * (double)n, t0);
}

static int64_t f_attention_ws_floats(int64_t Sk, int64_t D, int bf16) {
    return dev()->attention_ws_floats(Sk, D, bf16);
}

static void f_attention(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                        float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                        float scale, int bf16, float *ws) {
    const double t0 = mdt_now();
    if (H > 0 && Sq > 0)
        dev()->attention(q, k, v, out, ld_out, lse, H, Sq, Sk, sk_valid, D, scale, bf16, ws);
    const int64_t kv = sk_valid > Sk ? Sk : sk_valid; /* the keys attended */
    count(MDT_FLOP_ATTN, 4.0 * (double)H * (double)Sq * (double)kv * (double)D, t0);
    mdt_counters_get()->attn_calls++;
}

static void f_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                        const float *l, int64_t hn, int64_t L, int64_t D) {
    if (hn > 0 && L > 0) {
        const double t0 = mdt_now();
        dev()->lse_merge(O, ldO, Lr, o, ldo, l, hn, L, D);
        count(MDT_FLOP_ATTN, 0, t0);
    }
}

static const mdt_kernel_ops k_front = {
    .name = "front",
    .copy2d = f_copy2d,
    .copy_rows = f_copy_rows,
    .fill = f_fill,
    .add = f_add,
    .add_bias = f_add_bias,
    .angle_table = f_angle_table,
    .linear = f_linear,
    .layernorm_modulate = f_layernorm_modulate,
    .heads_prepare = f_heads_prepare,
    .rmsnorm = f_rmsnorm,
    .modulate_rows = f_modulate_rows,
    .gate_residual_rows = f_gate_residual_rows,
    .gate_residual = f_gate_residual,
    .swiglu = f_swiglu,
    .gelu_rows = f_gelu_rows,
    .silu = f_silu,
    .attention_ws_floats = f_attention_ws_floats,
    .attention = f_attention,
    .lse_merge = f_lse_merge,
};

const mdt_kernel_ops *mdt_k(void) { return &k_front; }
const mdt_kernel_ops *mdt_k_host(void) { return mdt_cpu_kernels(); }

mdt_status mdt_k_attention(mdt_arena *ar, const mdt_attn_args *a) {
    const int64_t n = k_front.attention_ws_floats(a->Sk, a->D, g_bf16);
    float *ws = NULL; /* n <= 0: the device keeps its own scratch */
    const mdt_arena_mark mk = mdt_arena_mark_get(ar);
    if (n > 0 && !(ws = mdt_arena_floats(ar, n)))
        return MDT_E_NOMEM;
    k_front.attention(a->q, a->k, a->v, a->out, a->ld_out, a->lse, a->H, a->Sq, a->Sk, a->kv, a->D,
                      a->scale, g_bf16, ws);
    mdt_arena_rewind(ar, mk);
    return MDT_OK;
}
