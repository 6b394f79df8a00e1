/*
 * cpu_isa.h — private to kernels/cpu: the table of kernels one build of cpu.c exports. cpu.c is
 * compiled once per instruction set; cpu_dispatch.c implements cpu.h by calling through the
 * table it picked (see mdt_cpu_isa). Members mirror cpu.h's functions, whose comments define them.
 */
#ifndef MDT_KERNELS_CPU_ISA_H
#define MDT_KERNELS_CPU_ISA_H

#include "cpu.h"

typedef struct mdt_cpu_kernels {
    const char *isa; /* "generic", "x86-64", "avx2", "avx512" */
    void (*linear_bf16)(const float *x, int64_t ldx, const uint16_t *wh, const float *b, float *y,
                        int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws, int64_t ws_floats);
    int64_t (*linear_bf16_ws_floats)(int64_t K, int64_t N);
    void (*bf16_widen)(float *dst, const uint16_t *src, int64_t n);
    void (*to_bf16_rows)(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t M,
                         int64_t n);
    void (*layernorm_modulate)(const float *x, float *y, int64_t M, int64_t C, float eps,
                               const float *shift, const float *scale);
    void (*heads_prepare)(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                          const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                          int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0);
    void (*rmsnorm)(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps);
    void (*modulate_rows)(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                          const int64_t *idx, int64_t shift_off, int64_t scale_off);
    void (*gate_residual_rows)(float *x, const float *y, int64_t ldy, const float *table,
                               int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                               int64_t C);
    void (*swiglu)(const float *in, float *out, int64_t M, int64_t n);
    void (*gelu_tanh)(float *x, int64_t n);
    void (*silu)(float *x, int64_t n);
    void (*gate_residual)(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                          int64_t C);
    void (*angle_table)(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                        const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                        float *sin_t);
    void (*copy2d)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                   int64_t cols);
    void (*copy_rows)(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                      const int64_t *srow, int64_t n, int64_t w);
    void (*fill)(float *x, int64_t n, float v);
    void (*add)(float *y, const float *x, int64_t n);
    void (*add_bias)(float *y, int64_t ldy, const float *b, int64_t M, int64_t N);
    void (*gelu_rows)(float *x, int64_t ld, int64_t M, int64_t n);
    void (*lse_merge)(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo, const float *l,
                      int64_t hn, int64_t L, int64_t D);
    int64_t (*attention_ws_floats)(int64_t Sk, int64_t D, int bf16);
    void (*attention)(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                      float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                      float scale, int bf16, float *ws);
} mdt_cpu_kernels;

/* x86-64 builds carry the first three; other architectures the generic one. */
extern const mdt_cpu_kernels mdt_cpu_kernels_x86_64, mdt_cpu_kernels_avx2, mdt_cpu_kernels_avx512,
    mdt_cpu_kernels_generic;

#endif /* MDT_KERNELS_CPU_ISA_H */
