/*
 * cpu.h — fast CPU kernels: BLAS GEMMs, fused elementwise passes and tiled online-softmax
 * attention. Each has a counterpart in kernels/ref that the unit tests compare against.
 *
 * Kernels never allocate: scratch comes from the caller (see mdt_cpu_attention_ws_floats).
 * Kernels add their FLOPs to the per-process counters (core.h).
 */
#ifndef MDT_KERNELS_CPU_H
#define MDT_KERNELS_CPU_H

#include "core/core.h"

#include <stdint.h>

/* Which build of these kernels runs: cpu.c is compiled per instruction set ("x86-64", "avx2"
 * with FMA, "avx512"; "generic" off x86-64) and the widest this CPU supports is used, unless
 * MESHDIT_CPU_ISA names another (read at first use). The build in use: */
const char *mdt_cpu_isa(void);
/* 1 if the kernel set `name` is built and this CPU runs it. */
int mdt_cpu_isa_available(const char *name);
/* Switches to kernel set `name` ("auto": the widest); MDT_E_UNSUPPORTED with what this machine
 * runs if it is unknown or the CPU lacks its instructions. Call before any kernel runs. */
mdt_status mdt_cpu_isa_select(const char *name);

/* The GEMMs below run on the GEMM path in use (gemm.h: OpenBLAS or oneDNN, MESHDIT_CPU_GEMM). */
/* y[M, N] = x[M, K] . w[N, K]^T (+ b[N]); x rows have stride ldx (>= K), y rows ldy (>= N). */
void mdt_cpu_linear(const float *x, int64_t ldx, const float *w, const float *b, float *y,
                    int64_t ldy, int64_t M, int64_t K, int64_t N);
/* The same product with bf16 weights wh[N, K] (the top 16 bits of each f32 weight).
 * onednn path: x is rounded to bf16 into the scratch ws and multiplied as bf16 x bf16 with fp32
 * accumulation (AVX512-BF16 / AMX).
 * openblas path: fp32 arithmetic and accumulation: the weights are widened (exactly) into the
 * scratch ws[ws_floats] in panels and multiplied by sgemm. Few rows (M < MDT_CPU_BF16_FEW_ROWS,
 * e.g. the AdaLN projections of the batch rows): panels of whole weight rows small enough for L2,
 * so the weights come from memory once at 2 bytes each; many rows: the whole matrix when ws holds
 * it, else blocks of K columns as large as ws allows. ws_floats >= max(K, N).
 * mdt_cpu_linear_bf16_ws_floats is the size that keeps the path at full speed (M: the most rows
 * a call will have; the onednn path needs M K / 2 floats). */
#define MDT_CPU_BF16_FEW_ROWS 32
void mdt_cpu_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b, float *y,
                         int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws,
                         int64_t ws_floats);
int64_t mdt_cpu_linear_bf16_ws_floats(int64_t M, int64_t K, int64_t N);
/* dst[i, 0:n] = bf16(src[i, 0:n]) for M rows (rounded to nearest even; NaN stays NaN). */
void mdt_cpu_to_bf16_rows(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t M,
                          int64_t n);
/* dst[n] = the f32 value of bf16 src[n] (exact). */
void mdt_cpu_bf16_widen(float *dst, const uint16_t *src, int64_t n);

/* y[M, C] = LayerNorm(x[M, C]) (no affine), then, if shift/scale are given, y*(1+scale)+shift. */
void mdt_cpu_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                                const float *shift, const float *scale);
/* RoPE conventions: interleaved pairs (2m, 2m+1) over all D channels (Flux), or rotate-half over
 * the first `rot` channels with the rest passed through (MiniMax-H3: x1 | x2 halves, (-x2, x1)). */
typedef enum { MDT_ROPE_INTERLEAVED = 0, MDT_ROPE_HALF } mdt_rope_kind;

/* Per-token, per-head preparation of attention operands from a projection output:
 * src rows [S, ld] hold heads [H, D] starting at column 0; dst is head-major [H, Sdst, D] and
 * rows s land at dst row s0 + s. If `norm_w` is given: RMSNorm over D with that weight (eps);
 * if `cos_t`/`sin_t` [S, rot] are given: RoPE of kind `kind` on the first `rot` channels (after
 * the norm; interleaved needs rot = D). */
void mdt_cpu_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                           const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                           int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0);
/* y[M, C] = x / sqrt(mean(x^2) + eps) * w (w may be NULL: no weight). */
void mdt_cpu_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps);
/* Per-row modulation from a table: y[i] = y[i] * (1 + table[idx[i]][scale_off..]) +
 * table[idx[i]][shift_off..], rows of the table `ld` floats apart. */
void mdt_cpu_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                           const int64_t *idx, int64_t shift_off, int64_t scale_off);
/* x[i] += table[idx[i]][gate_off..] * y[i] (y rows ldy apart). */
void mdt_cpu_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table,
                                int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                                int64_t C);
/* SwiGLU: out[M, n] = in[:, :n] * SiLU(in[:, n:2n]) with in [M, 2n] ([value | gate]). */
void mdt_cpu_swiglu(const float *in, float *out, int64_t M, int64_t n);
void mdt_cpu_gelu_tanh(float *x, int64_t n);
void mdt_cpu_silu(float *x, int64_t n);
/* x[M, C] += gate[C] * y[M, C]; y rows have stride ldy. */
void mdt_cpu_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                           int64_t C);

/* Rotary tables [S, ncols]: angle pos[s ldpos + col_axis[c]] x col_freq[c], with the product and
 * cos/sin in double (dbl, then rounded to float: diffusers' Flux) or in float (MiniMax-H3). */
void mdt_cpu_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                         const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                         float *sin_t);
/* dst[r, 0:cols] = src[r, 0:cols] for r < rows, rows ldd / lds floats apart. */
void mdt_cpu_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                    int64_t cols);
/* dst[drow[i]] = src[srow[i]] (w floats) for i < n; a NULL index is the identity. */
void mdt_cpu_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                       const int64_t *srow, int64_t n, int64_t w);
void mdt_cpu_fill(float *x, int64_t n, float v);
void mdt_cpu_add(float *y, const float *x, int64_t n); /* y += x */
/* y[i, 0:N] += b[0:N] for M rows ldy apart. */
void mdt_cpu_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N);
/* GELU(tanh) on the first n floats of M rows ld apart. */
void mdt_cpu_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n);
/* Merges a partial attention result (o [L, ldo] token-major over hn heads of D, l [hn, L]) into
 * the running one (O, Lr): O <- (e^Lr O + e^l o) / (e^Lr + e^l), Lr <- log(e^Lr + e^l), fp32
 * with the max factored out; rows whose partial is empty (l = -inf) are left alone. */
void mdt_cpu_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                       const float *l, int64_t hn, int64_t L, int64_t D);

/* Tiles of the online-softmax attention: f32 operands, and bf16 operands (oneDNN calls). */
#define MDT_ATTN_BQ 64
#define MDT_ATTN_BK 256
#ifndef MDT_ATTN_BQ16
#define MDT_ATTN_BQ16 256
#endif
#ifndef MDT_ATTN_BK16
#define MDT_ATTN_BK16 256
#endif
/* Floats of scratch one mdt_cpu_attention call needs for head dim D: O(tile) in f32; bf16
 * operands add one head's K and V in bf16 (Sk keys). */
int64_t mdt_cpu_attention_ws_floats(int64_t Sk, int64_t D, int bf16);
/* Attention over H heads of one batch element, tiled so memory is O(tile), never Sq x Sk:
 * q [H, Sq, D], k/v [H, Sk, D] head-major; out token-major: row i, head h at
 * out[i*ld_out + h*D]; lse [H, Sq] natural-log softmax denominators (NULL: not wanted). Only the
 * first `sk_valid` keys are attended (padded keys beyond it are masked). bf16 != 0 (onednn path
 * only): Q, K, V and the probabilities P are rounded to bf16 as operands of the two products;
 * softmax, its running max and denominator and the accumulator stay fp32. */
void mdt_cpu_attention(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                       float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                       float scale, int bf16, float *ws);

#endif /* MDT_KERNELS_CPU_H */
