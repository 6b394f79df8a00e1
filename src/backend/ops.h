/*
 * ops.h — the kernel and memory interface every compute backend implements: the seam between the
 * models (which say what to compute) and the devices (which compute it). The CPU backend
 * (backend.c, on kernels/cpu) and the CUDA backend (kernels/cuda, a plugin built by nvcc and
 * dlopen'ed at run time so that CPU-only builds and tests never link CUDA) fill one table each.
 *
 * Plain C, no meshdit headers: the plugin is compiled on its own against this file alone.
 * Conventions: every pointer an op takes is in the backend's memory (device memory for CUDA)
 * unless its name says host; ops are ordered on the backend's one compute stream and may return
 * before the work is done; `check` waits for everything and reports the first failure.
 * Shapes as in kernels/cpu/cpu.h, whose comments define each op exactly.
 */
#ifndef MDT_BACKEND_OPS_H
#define MDT_BACKEND_OPS_H

#include <stddef.h>
#include <stdint.h>

#define MDT_BACKEND_ABI 3

typedef struct mdt_backend_ops {
    int abi; /* MDT_BACKEND_ABI */
    const char *name;
    /* Starts the backend on device `ordinal`; 0 or -1 with a one-line reason in err. */
    int (*init)(int ordinal, char *err, size_t errlen);
    /* Waits for all queued work; 0 or -1 with the first asynchronous failure in err. */
    int (*check)(char *err, size_t errlen);
    void (*shutdown)(void);
    int (*device_count)(void);
    /* A one-line description of the device ("NVIDIA H200, 132 SMs, 139.8 GiB"). */
    void (*describe)(char *buf, size_t n);
    /* Memory: device buffers, pinned host buffers and copies. */
    int (*is_device)(const void *p);
    void *(*alloc)(size_t bytes); /* NULL on failure */
    void (*free)(void *p);
    void *(*host_alloc)(size_t bytes); /* page-locked host memory, NULL on failure */
    void (*host_free)(void *p);
    void (*to_device)(void *dst, const void *host_src, size_t bytes);
    /* Loader path: queued on the stream, returns at once so the copy overlaps the next disk
     * read; the (page-locked) host buffer must stay untouched until `check`. `to_device` above
     * returns only when the host buffer may be reused. */
    void (*to_device_async)(void *dst, const void *host_src, size_t bytes);
    void (*to_host)(void *host_dst, const void *src, size_t bytes); /* waits for the stream */
    int64_t (*mem_peak)(void); /* most device bytes allocated at once */
    /* Data movement: dst[r, 0:cols] = src[r, 0:cols] with row strides; row-indexed copy (a NULL
     * index is the identity): dst[drow[i]] = src[srow[i]] for i < n, w floats each. */
    void (*copy2d)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                   int64_t cols);
    void (*copy_rows)(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                      const int64_t *srow, int64_t n, int64_t w);
    void (*fill)(float *x, int64_t n, float v);
    void (*add)(float *y, const float *x, int64_t n);
    void (*add_bias)(float *y, int64_t ldy, const float *b, int64_t M, int64_t N); /* y[i] += b */
    void (*to_bf16)(uint16_t *dst, const float *src, int64_t n);
    /* Rotary tables: cos/sin[s, c] of pos[s ldpos + col_axis[c]] x col_freq[c], the product and
     * cos/sin in double (dbl) or in float; [S, ncols]. */
    void (*angle_table)(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                        const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                        float *sin_t);
    /* y = x w^T (+ b) with fp32 (w) or bf16 (wh, fp32 accumulation) weights. */
    void (*linear)(const float *x, int64_t ldx, const float *w, const uint16_t *wh, const float *b,
                   float *y, int64_t ldy, int64_t M, int64_t K, int64_t N);
    void (*layernorm_modulate)(const float *x, float *y, int64_t M, int64_t C, float eps,
                               const float *shift, const float *scale);
    void (*heads_prepare)(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                          const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                          int64_t rot, int half_rope, float *dst, int64_t Sdst, int64_t s0);
    void (*rmsnorm)(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps);
    void (*modulate_rows)(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                          const int64_t *idx, int64_t shift_off, int64_t scale_off);
    void (*gate_residual_rows)(float *x, const float *y, int64_t ldy, const float *table,
                               int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                               int64_t C);
    void (*gate_residual)(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                          int64_t C);
    void (*swiglu)(const float *in, float *out, int64_t M, int64_t n);
    void (*gelu_rows)(float *x, int64_t ld, int64_t M, int64_t n); /* GELU(tanh), n per row */
    void (*silu)(float *x, int64_t n);
    /* Attention as mdt_cpu_attention; bf16 != 0: bf16 operands on the tensor cores with fp32
     * accumulation and fp32 softmax (CUDA: 1 = the mma.sync flash kernel, 2 = the WMMA kernel
     * kept as a cross-check; head dims other than 64 and 128 run the f32 kernel). Scratch is the
     * backend's own. */
    void (*attention)(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                      float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                      float scale, int bf16);
    /* Log-sum-exp merge of a partial attention result into the running one (attn.c). */
    void (*lse_merge)(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo, const float *l,
                      int64_t hn, int64_t L, int64_t D);
    /* NCCL (NULL when the backend has none). id: 128 bytes made by one rank and broadcast. */
    int (*comm_id)(void *id128);
    void *(*comm_init)(int nranks, const void *id128, int rank, char *err, size_t errlen);
    void (*comm_free)(void *comm);
    /* Bit-identical sum: reduce-scatter then all-gather (n padded by the backend). */
    int (*comm_allreduce)(void *comm, float *buf, int64_t n, int nranks);
    /* Grouped sends/receives: to/from every peer p, counts in floats (0 = skip). */
    int (*comm_alltoallv)(void *comm, int nranks, const float *send, const int64_t *scounts,
                          const int64_t *sdispls, float *recv, const int64_t *rcounts,
                          const int64_t *rdispls);
    /* Ring step on the communication stream: send n floats to `to`, receive from `from`;
     * returns at once, `comm_wait` makes the compute stream wait for it. */
    int (*comm_sendrecv)(void *comm, const float *send, int to, float *recv, int from, int64_t n);
    int (*comm_wait)(void *comm);
} mdt_backend_ops;

/* The symbol the CUDA plugin exports. */
typedef const mdt_backend_ops *(*mdt_backend_entry_fn)(void);
#define MDT_BACKEND_ENTRY "mdt_cuda_backend"

#endif /* MDT_BACKEND_OPS_H */
