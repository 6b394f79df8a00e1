/*
 * backend.h — the compute backend of this process (CPU or CUDA, chosen at run time) and the one
 * kernel table callers use: mdt_k() (kernels/ops.h defines every op). Its entries skip empty
 * work, count FLOPs for every device in one place (core.h counters) and forward to the active
 * device table: on the CPU the kernel set in use (kernels/cpu) with the CPU backend's linear
 * (backend/cpu_backend.c), on CUDA the plugin's. Activations live in the model's arena, which
 * hands out device memory when the backend has a device (mdt_backend_mem).
 *
 * Not here: collectives (comm/mesh.c stages device buffers, or uses the device library's table,
 * mdt_backend_device_comm, handed to it by the caller).
 */
#ifndef MDT_BACKEND_H
#define MDT_BACKEND_H

#include "comm/device_comm.h"
#include "core/core.h"
#include "kernels/ops.h"

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
/* Prepacked linear weights on the CPU backend in f32 (kernels/cpu/gemm.h: oneDNN's blocked
 * layout, kept from the load on instead of made on every GEMM; MESHDIT_CPU_PACK=off, read by
 * mdt_backend_select, keeps them plain): the floats [N, K] weights take packed, 0 where they
 * stay plain (a device, bf16, a GEMM path that does not pack). pack: w [N, K] into dst (no
 * overlap), after which the linear slot multiplies dst on that layout; unpack: a packed copy back
 * to plain w; forget: dst no longer holds packed weights (before it is freed or reused). */
int64_t mdt_backend_packed_floats(int64_t N, int64_t K);
mdt_status mdt_backend_pack(const float *w, float *dst, int64_t N, int64_t K);
mdt_status mdt_backend_unpack(const float *src, float *w, int64_t N, int64_t K);
void mdt_backend_packed_forget(const float *p);
/* forget_range: every packed weights inside [lo, lo + bytes) (a host buffer just allocated). */
void mdt_backend_packed_forget_range(const void *lo, int64_t bytes);
mdt_backend_kind mdt_backend_kind_get(void);
const char *mdt_backend_name(void);
int mdt_backend_bf16(void);
/* The device's lifecycle and memory table (NULL on the CPU backend). */
const mdt_device_ops *mdt_backend_device_ops(void);
/* The device's collectives (NULL on the CPU backend, or when the plugin has none): give it to
 * mdt_mesh_use_comm. */
const mdt_device_comm *mdt_backend_device_comm(void);
/* The active device kernel table, without the front's counting and checks (tests compare
 * devices with it; everything else calls mdt_k()). */
const mdt_kernel_ops *mdt_backend_kernels(void);
/* Device memory for arenas (NULL on the CPU backend: host memory). */
const mdt_mem_source *mdt_backend_mem(void);
/* Page-locked host memory for staging arenas (NULL on the CPU backend: plain host memory). */
const mdt_mem_source *mdt_backend_host_mem(void);
/* Waits for queued device work; MDT_E_INVALID with the device's message on failure. */
mdt_status mdt_backend_check(void);
/* Device description for reports ("cpu" on the CPU backend). */
void mdt_backend_describe(char *buf, size_t n);
/* meshdit.h's mdt_cpu_kernels_select and mdt_device_info_get (the CPU kernel set and GEMM path,
 * what is in force) are the backend's too: implemented in backend.c, so that no layer above it
 * reaches into kernels/cpu. */

/* ---- kernels ---- */
/* The front table: every op of kernels/ops.h on the backend's memory, e.g.
 * mdt_k()->linear(x, ldx, w, wh, b, y, ldy, M, K, N). Ops with nothing to do (M <= 0, ...)
 * return at once. FLOPs (counted whatever the device): linear 2 M N K (MDT_FLOP_LINEAR);
 * attention 4 H Sq min(sk_valid, Sk) D (MDT_FLOP_ATTN) and one attn_call; MDT_FLOP_OTHER:
 * layernorm_modulate 8 M C, heads_prepare 8 S H D, rmsnorm 4 M C, modulate_rows 3 M C,
 * gate_residual(_rows) 2 M C, swiglu 6 M n, gelu_rows 10 M n, silu 5 n; data movement, rotary
 * tables and lse_merge count none. linear: the backend decides between w and wh (wh only with
 * bf16 weights selected). attention: prefer mdt_k_attention, which sizes the scratch and sets
 * the operand precision. */
const mdt_kernel_ops *mdt_k(void);
/* The same ops on host memory, whatever the backend (the CPU kernel set, uncounted): for work a
 * forward does on its host staging buffers before an upload (gathering input rows). */
const mdt_kernel_ops *mdt_k_host(void);
/* One attention call: the Sq query rows of H heads over a block of Sk key rows, of which the
 * first kv are valid (the rest are padding, masked: a ring block padded to the longest). */
typedef struct mdt_attn_args {
    const float *q;        /* [H, Sq, D] head-major */
    const float *k, *v;    /* [H, Sk, D] head-major */
    float *out;            /* [Sq, ld_out] token-major, heads at columns [0, H D) */
    int64_t ld_out;        /* floats between output rows */
    float *lse;            /* [H, Sq] each row's log-sum-exp (for a merge), or NULL */
    int64_t H, Sq, Sk, kv; /* heads, query rows, key rows held, valid key rows (kv <= Sk) */
    int64_t D;             /* head width */
    float scale;           /* on q . k */
} mdt_attn_args;
/* Attention through mdt_k() with the backend's operand precision (bf16 operands when bf16
 * weights were selected and the device has them); the scratch comes from `ar` and is given
 * back. MDT_E_NOMEM if the arena cannot hold it. */
mdt_status mdt_k_attention(mdt_arena *ar, const mdt_attn_args *a);

/* ---- memory ---- */
/* A device copy of n host bytes in arena `a` (the host pointer itself on the CPU backend). */
void *mdt_k_upload(mdt_arena *a, const void *host, size_t bytes);
void mdt_k_to_host(void *host_dst, const void *src, size_t bytes);
/* x [M, K] (rows ldx apart) is the input of the next several linear calls and stays unchanged
 * until mdt_k_shared_end: where GEMM operands are rounded to bf16 (CPU bf16 operands) it is
 * rounded once here and every linear on exactly this x reuses it (one conversion per
 * activation, not per GEMM). Elsewhere both do nothing. One shared input at a time; a nested
 * begin on the same x keeps it until the matching end. */
void mdt_k_shared_begin(const float *x, int64_t ldx, int64_t M, int64_t K);
void mdt_k_shared_end(void);

/* The CPU's bf16 path (cpu_backend.h: mdt_cpu_backend_measure_bf16), measured here, and set:
 * operands (1) or widening (0), with `why` for the plan line. A no-op off the CPU backend or
 * without bf16 weights. */
mdt_status mdt_backend_measure_bf16(int *operands, double *t_ops, double *t_widen, int *asked);
void mdt_backend_set_bf16_operands(int operands, const char *why);

#endif /* MDT_BACKEND_H */
