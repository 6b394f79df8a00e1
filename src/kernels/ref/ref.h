/*
 * ref.h — slow, readable reference kernels: the oracle the unit tests hold the fast kernels to.
 *
 * Plain loops, double accumulation where it costs nothing in clarity, no BLAS, no tiling. Never
 * called by the model code. Shapes are row-major; [M, K] means M rows of K floats.
 */
#ifndef MDT_KERNELS_REF_H
#define MDT_KERNELS_REF_H

#include <stdint.h>

/* y[M, N] = x[M, K] . w[N, K]^T (+ b[N] if b) */
void mdt_ref_linear(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t K,
                    int64_t N);
/* The same with bf16 weights wh[N, K]: each weight is the f32 whose top 16 bits are wh. */
void mdt_ref_linear_bf16(const float *x, const uint16_t *wh, const float *b, float *y, int64_t M,
                         int64_t K, int64_t N);
/* x[i] = the nearest bf16 value (ties to even): what the onednn GEMM path gives its operands. */
void mdt_ref_round_bf16(float *x, int64_t n);
/* y[M, C] = LayerNorm(x) without affine (biased variance) */
void mdt_ref_layernorm(const float *x, float *y, int64_t M, int64_t C, float eps);
/* y[M, D] = x / sqrt(mean(x^2) + eps) * w[D] */
void mdt_ref_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps);
/* x = x * (1 + scale[C]) + shift[C] for every row of x[M, C] */
void mdt_ref_modulate(float *x, const float *shift, const float *scale, int64_t M, int64_t C);
void mdt_ref_gelu_tanh(float *x, int64_t n);
void mdt_ref_silu(float *x, int64_t n);
/* Interleaved-pair RoPE on x[S, H, D] with cos/sin[S, D] (each pair's value repeated twice):
 * out[2m] = x[2m] cos - x[2m+1] sin, out[2m+1] = x[2m+1] cos + x[2m] sin. */
void mdt_ref_rope_interleaved(float *x, const float *cos_t, const float *sin_t, int64_t S,
                              int64_t H, int64_t D);
/* Rotate-half RoPE on the first `rot` channels of every head of x[S, H, D] with cos/sin[S, rot]:
 * halves x1 = x[:rot/2], x2 = x[rot/2:rot]; out = x * cos + (-x2, x1) * sin; the rest unchanged. */
void mdt_ref_rope_half(float *x, const float *cos_t, const float *sin_t, int64_t S, int64_t H,
                       int64_t D, int64_t rot);
/* out[M, n] = in[:, :n] * SiLU(in[:, n:]) for in [M, 2n]. */
void mdt_ref_swiglu(const float *in, float *out, int64_t M, int64_t n);

/* Attention of one head: q[Sq, D], k/v[Sk, D] -> out[Sq, D], lse[Sq] (natural log of the softmax
 * denominator of the scaled scores; may be NULL). Materialises the Sq x Sk scores. */
void mdt_ref_attention(const float *q, const float *k, const float *v, float *out, float *lse,
                       int64_t Sq, int64_t Sk, int64_t D, float scale);

#endif /* MDT_KERNELS_REF_H */
