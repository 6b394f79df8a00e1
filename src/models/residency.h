/*
 * residency.h — private to models/: where a loaded model's weights live and the moves between
 * those places (residency.c). Used by the loader, the in-memory path and the writer.
 */
#ifndef MDT_MODELS_RESIDENCY_H
#define MDT_MODELS_RESIDENCY_H

#include "models/model.h"

/* bf16 linear weights on the host: the CPU backend under --dtype bf16. */
int mdt_res_host_bf16(void);
/* Allocates the weights buffer for TP coordinate k of degree T (local shapes differ by
 * coordinate where a tensor splits unevenly) and points every tensor's state `ws` at its slot.
 * With `hbuf_out` (CPU bf16), linear weights get slots in a second, bf16 buffer instead (ws[i].h,
 * ws[i].data NULL): the packed form, half their bytes. Sets m->weight_bytes. */
mdt_status mdt_res_alloc(mdt_model *m, int T, int k, float **buf_out, uint16_t **hbuf_out,
                         mdt_wstate *ws);
/* Frees a host weights buffer from mdt_res_alloc (page-locked or not). */
void mdt_res_free_host(mdt_model *m, float *buf);
/* Every bf16 linear's widening scratch, reserved now so a forward never runs out (CPU bf16). */
mdt_status mdt_res_reserve_linear(const mdt_model *m);
/* Points every binding (family struct fields) at the host slots. */
void mdt_res_bind(mdt_model *m);
/* Device weights: allocate the slots; queue tensor i's host slice (returns at once, so the next
 * read overlaps the copy); wait, free the host buffer and bind the device slots; free them. */
mdt_status mdt_res_dev_prepare(mdt_model *m);
void mdt_res_dev_upload(mdt_model *m, int i);
/* The same from `src` (f32, tensor i's local shape) instead of its host slice: a LoRA's fused
 * shard or its base read again go up the load's path (bf16 slots rounded on the device). */
void mdt_res_dev_upload_from(mdt_model *m, int i, const float *src);
mdt_status mdt_res_dev_finish(mdt_model *m);
void mdt_res_dev_release(mdt_model *m);
/* CPU f32: the linears that multiply token rows into the GEMM's packed layout (backend.h:
 * mdt_backend_pack), in place; a no-op where weights stay plain. mdt_res_forget_packed: before
 * the host buffer is freed. ws[i].packed says which tensors are packed. */
mdt_status mdt_res_pack(mdt_model *m);
void mdt_res_forget_packed(mdt_model *m);
/* Weights back to a plain f32 host buffer (for parallelize and gather), and to where the backend
 * computes (device, or the packed bf16 form on the CPU). */
mdt_status mdt_res_to_host(mdt_model *m);
mdt_status mdt_res_to_device(mdt_model *m);

#endif /* MDT_MODELS_RESIDENCY_H */
