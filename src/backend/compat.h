/*
 * compat.h — TEMPORARY, removed once models/ call mdt_k() (and cli/ calls mdt_mesh_use_comm):
 * the old per-op entry points as one-line wrappers over the front table, so models/ and cli/
 * compile unchanged until they are converted. New code must not use anything here.
 *
 * The conversion: mdt_k_<op>(...) -> mdt_k()-><op>(...) for every op below (mdt_k_attention,
 * mdt_k_upload, mdt_k_to_host and mdt_k_shared_begin/end stay); mdt_cpu_copy_rows(...) ->
 * mdt_cpu_kernels()->copy_rows(...); mdt_backend_ops -> mdt_device_ops;
 * mdt_mesh_use_device_comm(mesh, ops) -> mdt_mesh_use_comm(mesh, mdt_backend_device_comm()).
 */
#ifndef MDT_BACKEND_COMPAT_H
#define MDT_BACKEND_COMPAT_H

#include "backend/backend.h"
#include "comm/mesh.h"

typedef mdt_device_ops mdt_backend_ops;

static inline mdt_status mdt_mesh_use_device_comm(mdt_mesh *m, const mdt_device_ops *ops) {
    (void)ops;
    return mdt_mesh_use_comm(m, mdt_backend_device_comm());
}

static inline void mdt_cpu_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src,
                                     int64_t lds, const int64_t *srow, int64_t n, int64_t w) {
    mdt_cpu_kernels()->copy_rows(dst, ldd, drow, src, lds, srow, n, w);
}

static inline void mdt_k_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                                const float *b, float *y, int64_t ldy, int64_t M, int64_t K,
                                int64_t N) {
    mdt_k()->linear(x, ldx, w, wh, b, y, ldy, M, K, N);
}

static inline void mdt_k_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds,
                                int64_t rows, int64_t cols) {
    mdt_k()->copy2d(dst, ldd, src, lds, rows, cols);
}

static inline void mdt_k_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src,
                                   int64_t lds, const int64_t *srow, int64_t n, int64_t w) {
    mdt_k()->copy_rows(dst, ldd, drow, src, lds, srow, n, w);
}

static inline void mdt_k_fill(float *x, int64_t n, float v) { mdt_k()->fill(x, n, v); }

static inline void mdt_k_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                                     const int32_t *col_axis, const double *col_freq, int dbl,
                                     float *cos_t, float *sin_t) {
    mdt_k()->angle_table(pos, ldpos, S, ncols, col_axis, col_freq, dbl, cos_t, sin_t);
}

static inline void mdt_k_add(float *y, const float *x, int64_t n) { mdt_k()->add(y, x, n); }

static inline void mdt_k_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    mdt_k()->add_bias(y, ldy, b, M, N);
}

static inline void mdt_k_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C,
                                            float eps, const float *shift, const float *scale) {
    mdt_k()->layernorm_modulate(x, y, M, C, eps, shift, scale);
}

static inline void mdt_k_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H,
                                       int64_t D, const float *norm_w, float eps,
                                       const float *cos_t, const float *sin_t, int64_t rot,
                                       mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0) {
    mdt_k()->heads_prepare(src, ld, S, H, D, norm_w, eps, cos_t, sin_t, rot, kind, dst, Sdst, s0);
}

static inline void mdt_k_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C,
                                 float eps) {
    mdt_k()->rmsnorm(x, w, y, M, C, eps);
}

static inline void mdt_k_modulate_rows(float *y, int64_t M, int64_t C, const float *table,
                                       int64_t ld, const int64_t *idx, int64_t shift_off,
                                       int64_t scale_off) {
    mdt_k()->modulate_rows(y, M, C, table, ld, idx, shift_off, scale_off);
}

static inline void mdt_k_gate_residual_rows(float *x, const float *y, int64_t ldy,
                                            const float *table, int64_t ld, const int64_t *idx,
                                            int64_t gate_off, int64_t M, int64_t C) {
    mdt_k()->gate_residual_rows(x, y, ldy, table, ld, idx, gate_off, M, C);
}

static inline void mdt_k_gate_residual(float *x, const float *y, int64_t ldy, const float *gate,
                                       int64_t M, int64_t C) {
    mdt_k()->gate_residual(x, y, ldy, gate, M, C);
}

static inline void mdt_k_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    mdt_k()->swiglu(in, out, M, n);
}

static inline void mdt_k_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    mdt_k()->gelu_rows(x, ld, M, n);
}

static inline void mdt_k_silu(float *x, int64_t n) { mdt_k()->silu(x, n); }

static inline void mdt_k_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                                   const float *l, int64_t hn, int64_t L, int64_t D) {
    mdt_k()->lse_merge(O, ldO, Lr, o, ldo, l, hn, L, D);
}

#endif /* MDT_BACKEND_COMPAT_H */
