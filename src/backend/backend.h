/*
 * backend.h — the compute backend of this process (CPU or CUDA, chosen at run time) and the
 * kernel calls the models and attention make through it (mdt_k_*). On the CPU backend every
 * call is the kernels/cpu function of the same name; on CUDA it is the plugin's op (ops.h) on
 * device memory, with the same FLOP counting. Activations live in the model's arena, which
 * hands out device memory when the backend has a device (mdt_backend_mem).
 *
 * Not here: collectives (comm/mesh.c stages device buffers or uses the backend's NCCL ops).
 */
#ifndef MDT_BACKEND_H
#define MDT_BACKEND_H

#include "backend/ops.h"
#include "core/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

typedef enum mdt_backend_kind { MDT_BACKEND_CPU = 0, MDT_BACKEND_CUDA } mdt_backend_kind;

/* Chooses this process's backend (once, before any model is loaded): CUDA loads the plugin
 * (MESHDIT_CUDA_PLUGIN, else libmeshdit_cuda.so beside the executable) and starts device
 * `ordinal`. bf16: linear weights kept in bf16 (half their bytes) with fp32 arithmetic, on CUDA
 * also attention on bf16 tensor cores; on the CPU the weights are widened panel by panel into
 * the backend's scratch for sgemm (this machine has no bf16 dot-product instructions).
 * MDT_E_UNSUPPORTED with one line when the build or the machine has no CUDA device. */
mdt_status mdt_backend_select(mdt_backend_kind kind, int ordinal, int bf16);
/* Makes sure the CPU bf16 scratch covers a linear with weights [N, K] (no-op elsewhere), so
 * running out of memory is a load-time error; MDT_E_NOMEM otherwise. */
mdt_status mdt_backend_reserve_linear(int64_t K, int64_t N);
/* Frees the CPU backend's GEMM scratch (bf16 widening or operand panels, oneDNN's scratchpad);
 * the next load or forward takes it again. */
void mdt_backend_release_scratch(void);
/* Bytes of that scratch now held (0 unless CPU bf16). */
int64_t mdt_backend_scratch_bytes(void);
mdt_backend_kind mdt_backend_kind_get(void);
const char *mdt_backend_name(void);
int mdt_backend_bf16(void);
/* The plugin's ops (NULL on the CPU backend). */
const mdt_backend_ops *mdt_backend_device_ops(void);
/* Device memory for arenas (NULL on the CPU backend: host memory). */
const mdt_mem_source *mdt_backend_mem(void);
/* Page-locked host memory for staging arenas (NULL on the CPU backend: plain host memory). */
const mdt_mem_source *mdt_backend_host_mem(void);
/* Waits for queued device work; MDT_E_INVALID with the device's message on failure. */
mdt_status mdt_backend_check(void);
/* Device description for reports ("cpu" on the CPU backend). */
void mdt_backend_describe(char *buf, size_t n);

/* ---- memory ---- */
/* A device copy of n host bytes in arena `a` (the host pointer itself on the CPU backend). */
void *mdt_k_upload(mdt_arena *a, const void *host, size_t bytes);
void mdt_k_to_host(void *host_dst, const void *src, size_t bytes);

/* ---- kernels: see kernels/cpu/cpu.h and ops.h ---- */
void mdt_k_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh, const float *b,
                  float *y, int64_t ldy, int64_t M, int64_t K, int64_t N);
/* x [M, K] (rows ldx apart) is the input of the next several mdt_k_linear calls and stays
 * unchanged until mdt_k_shared_end: where GEMM operands are rounded to bf16 (CPU bf16 operands)
 * it is rounded once here and every linear on exactly this x reuses it (one conversion per
 * activation, not per GEMM). Elsewhere both do nothing. One shared input at a time; a nested
 * begin on the same x keeps it until the matching end. */
void mdt_k_shared_begin(const float *x, int64_t ldx, int64_t M, int64_t K);
void mdt_k_shared_end(void);
void mdt_k_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                  int64_t cols);
void mdt_k_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                     const int64_t *srow, int64_t n, int64_t w);
void mdt_k_fill(float *x, int64_t n, float v);
void mdt_k_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                       const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                       float *sin_t);
void mdt_k_add(float *y, const float *x, int64_t n);
void mdt_k_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N);
void mdt_k_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                              const float *shift, const float *scale);
void mdt_k_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                         const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                         int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0);
void mdt_k_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps);
void mdt_k_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                         const int64_t *idx, int64_t shift_off, int64_t scale_off);
void mdt_k_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table, int64_t ld,
                              const int64_t *idx, int64_t gate_off, int64_t M, int64_t C);
void mdt_k_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                         int64_t C);
void mdt_k_swiglu(const float *in, float *out, int64_t M, int64_t n);
void mdt_k_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n);
void mdt_k_silu(float *x, int64_t n);
/* Attention (mdt_cpu_attention); CPU scratch comes from `ar` and is given back. */
mdt_status mdt_k_attention(mdt_arena *ar, const float *q, const float *k, const float *v,
                           float *out, int64_t ld_out, float *lse, int64_t H, int64_t Sq,
                           int64_t Sk, int64_t sk_valid, int64_t D, float scale);
void mdt_k_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo, const float *l,
                     int64_t hn, int64_t L, int64_t D);

#endif /* MDT_BACKEND_H */
