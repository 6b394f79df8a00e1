/*
 * ops.h — the one backend interface: the table of kernel operations every compute backend fills
 * (mdt_kernel_ops, like ggml_backend_i), and its sibling for the device's lifecycle and memory
 * (mdt_device_ops). Each op is declared and defined here, once.
 *
 * Who fills what: each build of kernels/cpu/cpu.c (one per instruction set) exports a kernel
 * table; the CPU backend (backend/cpu_backend.c) takes the set in use and fills its `linear`
 * slot with the GEMM seam and the bf16 scratch; the CUDA plugin (kernels/cuda, built by nvcc,
 * opened at run time) exports both tables through MDT_BACKEND_ENTRY. backend.c wraps the active
 * table in the front table callers use (mdt_k()), which skips empty work and counts FLOPs for
 * every device in one place; device tables never count.
 *
 * Plain C, no meshdit headers: the plugin is compiled against this file alone. Conventions:
 * every pointer an op takes is in the backend's memory (device memory for CUDA) unless its name
 * says host; matrices are row-major with the given row strides (ld*, in floats); ops are ordered
 * on the backend's one compute stream and may return before the work is done (`check` waits and
 * reports the first failure); ops never allocate except where said (scratch is the caller's).
 */
#ifndef MDT_KERNELS_OPS_H
#define MDT_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

/* Version of both tables and of the plugin entry; a plugin of another version is refused. */
#define MDT_BACKEND_ABI 4

/* RoPE conventions: interleaved pairs (2m, 2m+1) over all D channels (Flux), or rotate-half over
 * the first `rot` channels with the rest passed through (MiniMax-H3: x1 | x2 halves, (-x2, x1)). */
typedef enum mdt_rope_kind { MDT_ROPE_INTERLEAVED = 0, MDT_ROPE_HALF } mdt_rope_kind;

typedef struct mdt_kernel_ops {
    /* The kernel set: "generic", "x86-64", "avx2", "avx512" (CPU), "cuda"; "front" for mdt_k(). */
    const char *name;

    /* ---- data movement ---- */
    /* dst[r, 0:cols] = src[r, 0:cols] for r < rows, rows ldd / lds floats apart. */
    void (*copy2d)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                   int64_t cols);
    /* dst[drow[i]] = src[srow[i]] (w floats) for i < n; a NULL index is the identity. */
    void (*copy_rows)(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                      const int64_t *srow, int64_t n, int64_t w);
    void (*fill)(float *x, int64_t n, float v);
    void (*add)(float *y, const float *x, int64_t n); /* y += x */
    /* y[i, 0:N] += b[0:N] for M rows ldy apart. */
    void (*add_bias)(float *y, int64_t ldy, const float *b, int64_t M, int64_t N);

    /* ---- rotary tables ---- */
    /* Rotary tables [S, ncols]: angle pos[s ldpos + col_axis[c]] x col_freq[c], with the product
     * and cos/sin in double (dbl, then rounded to float: diffusers' Flux) or in float
     * (MiniMax-H3). */
    void (*angle_table)(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                        const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                        float *sin_t);

    /* ---- GEMM ---- */
    /* y[M, N] = x[M, K] . w[N, K]^T (+ b[N]); x rows have stride ldx (>= K), y rows ldy (>= N).
     * Weights in fp32 (w, wh NULL) or in bf16 (wh[N, K], the top 16 bits of each f32 weight; w
     * is then ignored) with fp32 accumulation. Whether bf16 weights are used is the backend's
     * choice (mdt_backend_select), made in the front table; a CPU kernel set's own slot handles
     * fp32 weights only (the CPU backend fills the slot with one that has the bf16 scratch). */
    void (*linear)(const float *x, int64_t ldx, const float *w, const uint16_t *wh, const float *b,
                   float *y, int64_t ldy, int64_t M, int64_t K, int64_t N);

    /* ---- norms, modulation, activations ---- */
    /* y[M, C] = LayerNorm(x[M, C]) (no affine), then, if shift/scale are given,
     * y*(1+scale)+shift. */
    void (*layernorm_modulate)(const float *x, float *y, int64_t M, int64_t C, float eps,
                               const float *shift, const float *scale);
    /* Per-token, per-head preparation of attention operands from a projection output:
     * src rows [S, ld] hold heads [H, D] starting at column 0; dst is head-major [H, Sdst, D] and
     * rows s land at dst row s0 + s. If `norm_w` is given: RMSNorm over D with that weight (eps);
     * if `cos_t`/`sin_t` [S, rot] are given: RoPE of kind `kind` on the first `rot` channels
     * (after the norm; interleaved needs rot = D). */
    void (*heads_prepare)(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                          const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                          int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0);
    /* y[M, C] = x / sqrt(mean(x^2) + eps) * w (w may be NULL: no weight). */
    void (*rmsnorm)(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps);
    /* Per-row modulation from a table: y[i] = y[i] * (1 + table[idx[i]][scale_off..]) +
     * table[idx[i]][shift_off..], rows of the table `ld` floats apart; y [M, C]. */
    void (*modulate_rows)(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                          const int64_t *idx, int64_t shift_off, int64_t scale_off);
    /* x[i] += table[idx[i]][gate_off..] * y[i] (x [M, C], y rows ldy apart). */
    void (*gate_residual_rows)(float *x, const float *y, int64_t ldy, const float *table,
                               int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                               int64_t C);
    /* x[M, C] += gate[C] * y[M, C]; y rows have stride ldy. */
    void (*gate_residual)(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                          int64_t C);
    /* SwiGLU: out[M, n] = in[:, :n] * SiLU(in[:, n:2n]) with in [M, 2n] ([value | gate]). */
    void (*swiglu)(const float *in, float *out, int64_t M, int64_t n);
    /* GELU(tanh) on the first n floats of M rows ld apart. */
    void (*gelu_rows)(float *x, int64_t ld, int64_t M, int64_t n);
    void (*silu)(float *x, int64_t n); /* x = x * sigmoid(x) */

    /* ---- attention ---- */
    /* Floats of scratch one `attention` call needs for Sk keys of head dim D (0: the backend
     * needs none and ignores ws). */
    int64_t (*attention_ws_floats)(int64_t Sk, int64_t D, int bf16);
    /* Attention over H heads of one batch element, tiled so memory is O(tile), never Sq x Sk:
     * q [H, Sq, D], k/v [H, Sk, D] head-major; out token-major: row i, head h at
     * out[i*ld_out + h*D]; lse [H, Sq] natural-log softmax denominators (NULL: not wanted). Only
     * the first `sk_valid` keys are attended (padded keys beyond it are masked). bf16 != 0: Q,
     * K, V and the probabilities P are rounded to bf16 as operands of the two products; softmax,
     * its running max and denominator and the accumulator stay fp32 (CPU: only on the onednn
     * GEMM path, else f32; CUDA: 1 = the mma.sync flash kernel, 2 = the WMMA kernel kept as a
     * cross-check; head dims other than 64 and 128 run the f32 kernel). ws: scratch of
     * attention_ws_floats(Sk, D, bf16) floats. */
    void (*attention)(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                      float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                      float scale, int bf16, float *ws);
    /* Merges a partial attention result (o [L, ldo] token-major over hn heads of D, l [hn, L])
     * into the running one (O, Lr): O <- (e^Lr O + e^l o) / (e^Lr + e^l),
     * Lr <- log(e^Lr + e^l), fp32 with the max factored out; rows whose partial is empty
     * (l = -inf) are left alone. */
    void (*lse_merge)(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo, const float *l,
                      int64_t hn, int64_t L, int64_t D);
} mdt_kernel_ops;

/* A device's lifecycle and memory (the CPU backend has none: host memory, no table). */
typedef struct mdt_device_ops {
    /* Starts the backend on device `ordinal`; 0 or -1 with a one-line reason in err. */
    int (*init)(int ordinal, char *err, size_t errlen);
    /* Waits for all queued work; 0 or -1 with the first asynchronous failure in err. */
    int (*check)(char *err, size_t errlen);
    void (*shutdown)(void);
    int (*device_count)(void);
    /* A one-line description of the device ("NVIDIA H200, 132 SMs, 139.8 GiB"). */
    void (*describe)(char *buf, size_t n);
    int (*is_device)(const void *p);
    void *(*alloc)(size_t bytes); /* NULL on failure */
    void (*free)(void *p);
    void *(*host_alloc)(size_t bytes); /* page-locked host memory, NULL on failure */
    void (*host_free)(void *p);
    /* Returns when the host buffer may be reused. */
    void (*to_device)(void *dst, const void *host_src, size_t bytes);
    /* Loader path: queued on the stream, returns at once so the copy overlaps the next disk
     * read; the (page-locked) host buffer must stay untouched until `check`. */
    void (*to_device_async)(void *dst, const void *host_src, size_t bytes);
    void (*to_host)(void *host_dst, const void *src, size_t bytes); /* waits for the stream */
    int64_t (*mem_peak)(void); /* most device bytes allocated at once */
    /* Upload conversion of weights: dst[n] = bf16(src[n]) (nearest even), both on the device. */
    void (*to_bf16)(uint16_t *dst, const float *src, int64_t n);
} mdt_device_ops;

/* What a device plugin exports: both tables and their version. */
typedef struct mdt_backend_plugin {
    int abi; /* MDT_BACKEND_ABI */
    const char *name;
    const mdt_device_ops *dev;
    const mdt_kernel_ops *kernels;
} mdt_backend_plugin;

/* The symbol the CUDA plugin exports. */
typedef const mdt_backend_plugin *(*mdt_backend_entry_fn)(void);
#define MDT_BACKEND_ENTRY "mdt_cuda_backend"

#endif /* MDT_KERNELS_OPS_H */
