/*
 * cpu.h — the fast CPU kernel sets: BLAS GEMMs, fused elementwise passes and tiled online-softmax
 * attention, behind the kernel table of kernels/ops.h (whose comments define every op). Each op
 * has a counterpart in kernels/ref that the unit tests compare against.
 *
 * cpu.c is compiled once per instruction set ("x86-64", "avx2" with FMA, "avx512"; "generic" off
 * x86-64), each build exporting one mdt_cpu_kernel_set; the widest this CPU supports is used,
 * unless MESHDIT_CPU_ISA names another (read at first use). Kernels never allocate (scratch comes
 * from the caller) and count nothing (backend.c's front table counts for every device).
 */
#ifndef MDT_KERNELS_CPU_H
#define MDT_KERNELS_CPU_H

#include "core/core.h"
#include "kernels/ops.h"

#include <stdint.h>

/* The build in use ("x86-64", "avx2", "avx512", "generic"). */
const char *mdt_cpu_isa(void);
/* 1 if the kernel set `name` is built and this CPU runs it. */
int mdt_cpu_isa_available(const char *name);
/* Switches to kernel set `name` ("auto": the widest); MDT_E_UNSUPPORTED with what this machine
 * runs if it is unknown or the CPU lacks its instructions. Call before any kernel runs. */
mdt_status mdt_cpu_isa_select(const char *name);

/* One build of cpu.c: the portable ops, and the host-only pieces the CPU backend
 * (backend/cpu_backend.c) builds its bf16 linear from. In `k`, `linear` takes fp32 weights only
 * (wh must be NULL) and `attention` uses bf16 operands only on the onednn GEMM path (gemm.h;
 * elsewhere bf16 is ignored, in attention_ws_floats too). */
typedef struct mdt_cpu_kernel_set {
    mdt_kernel_ops k; /* k.name: the instruction set */
    /* y[M, N] = x[M, K] . bf16 wh[N, K]^T (+ b) in fp32 arithmetic and accumulation: the weights
     * are widened (exactly) into the scratch ws[ws_floats] in panels and multiplied by sgemm. Few
     * rows (M < MDT_CPU_BF16_FEW_ROWS, e.g. the AdaLN projections of the batch rows): panels of
     * whole weight rows small enough for L2, so the weights come from memory once at 2 bytes
     * each; many rows: the whole matrix when ws holds it, else blocks of K columns as large as ws
     * allows. ws_floats >= max(K, N). */
    void (*linear_bf16)(const float *x, int64_t ldx, const uint16_t *wh, const float *b, float *y,
                        int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws, int64_t ws_floats);
    /* The scratch that keeps linear_bf16 at full speed for weights [N, K]. */
    int64_t (*linear_bf16_ws_floats)(int64_t K, int64_t N);
    /* dst[i, 0:n] = bf16(src[i, 0:n]) for M rows (rounded to nearest even; NaN stays NaN). */
    void (*to_bf16_rows)(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t M,
                         int64_t n);
    /* dst[n] = the f32 value of bf16 src[n] (exact). */
    void (*bf16_widen)(float *dst, const uint16_t *src, int64_t n);
    /* One row: y [N] = w [N, K] . x [K] (+ b), K > 0: the f32 linear's one-row form (gemm.c
     * takes it for M = 1); NULL in the sets below AVX2, which leave it to the GEMM path. */
    void (*gemv_f32)(const float *x, const float *w, const float *b, float *y, int64_t K,
                     int64_t N);
} mdt_cpu_kernel_set;
#define MDT_CPU_BF16_FEW_ROWS 32

/* The kernel set in use (picked at first use, or by mdt_cpu_isa_select), and its portable ops:
 * host memory, whatever device the backend runs on (e.g. row copies of host buffers). */
const mdt_cpu_kernel_set *mdt_cpu_kernel_set_get(void);
const mdt_kernel_ops *mdt_cpu_kernels(void);

/* Tiles of the online-softmax attention: f32 operands, and bf16 operands (oneDNN calls). */
#define MDT_ATTN_BQ 256
#define MDT_ATTN_BK 256
#ifndef MDT_ATTN_BQ16
#define MDT_ATTN_BQ16 256
#endif
#ifndef MDT_ATTN_BK16
#define MDT_ATTN_BK16 256
#endif

#endif /* MDT_KERNELS_CPU_H */
