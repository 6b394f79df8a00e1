/*
 * cpu_backend.h — the CPU backend (private to backend/, and to the kernel tests): its device
 * kernel table is the kernel set in use (kernels/cpu) with the `linear` slot filled here from
 * the GEMM seam (kernels/cpu/gemm.h) and the backend's bf16 scratch, which it owns: the widening
 * panels, and the shared input rounded once (mdt_k_shared_begin). No FLOPs are counted here.
 */
#ifndef MDT_BACKEND_CPU_BACKEND_H
#define MDT_BACKEND_CPU_BACKEND_H

#include "core/core.h"
#include "kernels/ops.h"

/* (Re)starts the CPU backend with fp32 or bf16 linear weights; frees the scratch. */
void mdt_cpu_backend_start(int bf16);
/* bf16 weights on the CPU: bf16 GEMM operands, or the weights widened to f32 for the f32 GEMM.
 * MESHDIT_CPU_BF16 = operands | widen | auto (unset: auto). auto measures both on one linear of
 * a DiT's shape ([256, 1024] x [1024, 1024], best of 3 alternating in thread CPU time, about
 * 0.1 s): bf16 dot products run at half the FMA rate on some cores (AVX512-BF16 without AMX),
 * where widening is faster; operands only where at least 10% faster (near a tie the more exact
 * widening, so the pick, and the run's bits, do not follow the load). *operands gets the choice,
 * *t_ops / *t_widen the seconds measured (0: not measured), *asked 1 where the variable chose
 * (operands or widen; 0 for auto). Nothing is set: mdt_cpu_gemm_set_bf16_operands does that. Local.
 */
mdt_status mdt_cpu_backend_measure_bf16(int *operands, double *t_ops, double *t_widen, int *asked);
/* The CPU backend's kernel table (the set in use, whose choice may change until work starts). */
const mdt_kernel_ops *mdt_cpu_backend_kernels(void);
/* As mdt_backend_reserve_linear / _release_scratch / _scratch_bytes (backend.h). */
mdt_status mdt_cpu_backend_reserve_linear(int64_t K, int64_t N);
void mdt_cpu_backend_release(void);
int64_t mdt_cpu_backend_scratch_bytes(void);
/* The first failure since the last call (scratch out of memory, a GEMM refused), cleared. */
mdt_status mdt_cpu_backend_check(void);
/* As mdt_k_shared_begin / _end (backend.h). */
void mdt_cpu_backend_shared_begin(const float *x, int64_t ldx, int64_t M, int64_t K);
void mdt_cpu_backend_shared_end(void);

/* y[M, N] = x[M, K] . bf16 wh[N, K]^T (+ b) on the GEMM path in use, with the caller's scratch
 * ws[ws_floats]: onednn path: x is rounded to bf16 into ws and multiplied as bf16 x bf16 with
 * fp32 accumulation (AVX512-BF16 / AMX); openblas path: the kernel set's linear_bf16 (weights
 * widened into ws, fp32 arithmetic). mdt_cpu_backend_linear_bf16_ws_floats is the size that
 * keeps either at full speed (M: the most rows a call will have; onednn needs M K / 2 floats). */
/* Prepacked f32 weights (kernels/cpu/gemm.h): the floats [N, K] weights take packed (0: kept
 * plain: bf16 weights, or a path that does not pack); pack w into dst and remember dst as packed
 * (the linear slot then runs it on that layout); unpack a packed copy into w (src stays packed);
 * forget dst (before its memory is freed or holds plain weights again). set_pack(0): nothing new
 * is packed from then on (packed_floats 0); weights already packed stay so, and pack still
 * rewrites them (a LoRA fuse or restore of a packed tensor). */
void mdt_cpu_backend_set_pack(int on);
int64_t mdt_cpu_backend_packed_floats(int64_t N, int64_t K);
mdt_status mdt_cpu_backend_pack(const float *w, float *dst, int64_t N, int64_t K);
mdt_status mdt_cpu_backend_unpack(const float *src, float *w, int64_t N, int64_t K);
void mdt_cpu_backend_packed_forget(const float *p);
/* Forgets every packed weights inside [lo, lo + bytes) (a buffer just allocated or freed). */
void mdt_cpu_backend_packed_forget_range(const void *lo, int64_t bytes);

void mdt_cpu_backend_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b,
                                 float *y, int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws,
                                 int64_t ws_floats);
int64_t mdt_cpu_backend_linear_bf16_ws_floats(int64_t M, int64_t K, int64_t N);

#endif /* MDT_BACKEND_CPU_BACKEND_H */
