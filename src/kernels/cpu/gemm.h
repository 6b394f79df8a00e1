/*
 * gemm.h — the CPU backend's one GEMM seam. Two paths, chosen once per process:
 *
 *   openblas  cblas_sgemm (f32 operands); bf16 weights are widened to f32 into panels first
 *             (the kernel sets' linear_bf16). The path on CPUs without AVX2 + FMA.
 *   onednn    oneDNN matmul primitives (the library PyTorch uses on x86): f32 operands,
 * or bf16 x bf16 operands with fp32 accumulation on AVX512-BF16 (vdpbf16ps) and AMX (tdpbf16ps) —
 * oneDNN picks its own kernel for the CPU, up to an instruction-set cap.
 *
 * Selection: MESHDIT_CPU_GEMM=auto|openblas|onednn|onednn-amx|onednn-avx512bf16|onednn-avx512|
 * onednn-avx2 (read at first use), or mdt_cpu_gemm_select before any GEMM runs. "auto" is onednn
 * when the CPU has AVX2 + FMA (oneDNN's lowest kernels here), else openblas: on AVX512-BF16/AMX
 * for the bf16 operands, and in f32 because on an AVX2-only core (Zen 1) oneDNN's step was as
 * fast as OpenBLAS's or 1-3% faster on a medium Flux step (1280 rows; one rank and the 2-rank
 * layouts) and 17-21% faster at the 96 rows of a 128-px image (docs/perf.md). A cap names the
 * widest instruction set oneDNN may use; one the CPU lacks is refused.
 *
 * With bf16 weights (`--dtype bf16`) on the onednn path, activations are rounded to bf16 (nearest
 * even) only as GEMM operands — the linears and attention's QK^T and PV products; norms, softmax,
 * the residual stream and every accumulation stay fp32. On the openblas path bf16 weights are
 * widened exactly and every operand is fp32.
 */
#ifndef MDT_KERNELS_CPU_GEMM_H
#define MDT_KERNELS_CPU_GEMM_H

#include "core/core.h"

#include <stdint.h>

/* The path in use: "openblas" or "onednn". */
const char *mdt_cpu_gemm(void);
/* A one-line description of the path and oneDNN's kernel instruction set
 * ("onednn (avx512_core_amx)", "openblas (Prescott)"). */
void mdt_cpu_gemm_describe(char *buf, int64_t n);
/* 1 if bf16 weights mean bf16 GEMM operands: the onednn path with oneDNN at AVX-512 or wider
 * (oneDNN has no bf16 matmul below it: onednn-avx2 widens bf16 weights like openblas and
 * multiplies f32 operands through oneDNN). */
int mdt_cpu_gemm_bf16_operands(void);
/* 1 if bf16 operands are possible (the onednn path at AVX-512 or wider). */
int mdt_cpu_gemm_bf16_operands_possible(void);
/* Chooses between bf16 operands (on = 1; only where possible) and widening bf16 weights to f32
 * (on = 0) for the rest of the process; `why` (copied) says why, for the plan line. */
void mdt_cpu_gemm_set_bf16_operands(int on, const char *why);
/* Why the bf16 path in force is that one ("" until mdt_cpu_gemm_set_bf16_operands). */
const char *mdt_cpu_gemm_bf16_why(void);
/* 1 if `name` is a path this CPU runs. */
int mdt_cpu_gemm_available(const char *name);
/* Switches to path `name` ("auto" or one of the names above). oneDNN's cap can be set once per
 * process: a second, different cap is refused ("onednn" keeps the cap already set).
 * MDT_E_UNSUPPORTED names what this CPU runs. */
mdt_status mdt_cpu_gemm_select(const char *name);

/* C[M, N] = alpha * A[M, K] . op(B) + beta * C, op(B) = B[N, K]^T (transb) or B[K, N]; row-major
 * with leading dimensions lda, ldb, ldc; beta is 0 or 1. bf16 != 0: A and B hold bf16 (uint16)
 * and the onednn path must be in use; otherwise f32. Counts no FLOPs (callers do). */
void mdt_cpu_gemm_run(int bf16, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                      const void *A, int64_t lda, const void *B, int64_t ldb, float beta, float *C,
                      int64_t ldc);

/* y[M, N] = x[M, K] . w[N, K]^T (+ b) through the path in use (the kernel sets' linear and the
 * CPU backend's bf16 linear call these; no FLOPs counted). The bf16 form rounds x to bf16 into the
 * caller's scratch xh[xh_halves] (>= M K, else the GEMM fails with mdt_cpu_gemm_error) and needs
 * the onednn path. */
void mdt_cpu_gemm_linear_f32(const float *x, int64_t ldx, const float *w, const float *b, float *y,
                             int64_t ldy, int64_t M, int64_t K, int64_t N);
void mdt_cpu_gemm_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b,
                              float *y, int64_t ldy, int64_t M, int64_t K, int64_t N, uint16_t *xh,
                              int64_t xh_halves);

/* The bf16 form on x already rounded: xh [M, K] bf16. */
void mdt_cpu_gemm_linear_bf16h(const uint16_t *xh, const uint16_t *wh, const float *b, float *y,
                               int64_t ldy, int64_t M, int64_t K, int64_t N);

/* The onednn path's form for few rows (gemm.c: the weights on the left, Ct = W . x^T, where
 * oneDNN's AVX-512 f32 kernels were measured faster): mode -1 (the default) by that shape rule,
 * 0 never, 1 for every f32 GEMM on [N, K] weights of two rows or more (tests and benchmarks
 * compare the forms). mdt_cpu_gemm_swapped counts the GEMMs run that way. */
void mdt_cpu_gemm_set_swap(int mode);
int64_t mdt_cpu_gemm_swapped(void);

/* Prepacked weights (gemm.c): [N, K] f32 weights kept in the blocked layout oneDNN's f32 matmul
 * would otherwise make of them on every call. mdt_cpu_gemm_packed_floats: the floats that layout
 * takes, or 0 where weights stay plain (the openblas path, oneDNN below AVX-512, a layout that is
 * the plain one). pack / unpack reorder between the plain row-major layout
 * and it (src and dst must not overlap; 0, or -1 with mdt_cpu_gemm_error); linear_packed is
 * mdt_cpu_gemm_linear_f32 on packed weights (any row count, through oneDNN whatever the path).
 * Whether to pack is the CPU backend's choice (cpu_backend.h: mdt_cpu_backend_set_pack). */
int64_t mdt_cpu_gemm_packed_floats(int64_t N, int64_t K);
int mdt_cpu_gemm_pack(const float *w, float *dst, int64_t N, int64_t K);
int mdt_cpu_gemm_unpack(const float *src, float *w, int64_t N, int64_t K);
void mdt_cpu_gemm_linear_packed(const float *x, int64_t ldx, const float *wp, const float *b,
                                float *y, int64_t ldy, int64_t M, int64_t K, int64_t N);

/* Frees the oneDNN scratchpad buffer and the swapped form's product (primitives stay cached);
 * the next GEMM takes them again. */
void mdt_cpu_gemm_release(void);

/* The first failure of a GEMM since the last call (oneDNN refused a shape, or its scratchpad
 * could not be allocated), or NULL; reading it clears it. The output of a failed GEMM is zeros. */
const char *mdt_cpu_gemm_error(void);

#endif /* MDT_KERNELS_CPU_GEMM_H */
