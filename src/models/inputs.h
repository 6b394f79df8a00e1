/*
 * inputs.h — a forward's named inputs, checked: presence, shape (-1 = any), dtype, and every
 * value finite (floats) or in range (indices). Errors name the tensor and the expectation.
 */
#ifndef MDT_MODELS_INPUTS_H
#define MDT_MODELS_INPUTS_H

#include "core/core.h"

/* The tensor `name` of `in` with shape `shape` converted to f32 (any float or integer dtype) into
 * the arena; NaN/Inf is an error naming the tensor and element. */
mdt_status mdt_input_f32(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         mdt_arena *a, float **out);
/* A per-sample input of shape [B, rest...] (`shape`, shape[0] = B) as mdt_input_f32 reads it, or
 * of shape [1, rest...] repeated to [B, rest...]: one value for the whole batch, which diffusers'
 * transformers broadcast (a [1] timestep or guidance with batch B). Errors name both shapes. */
mdt_status mdt_input_f32_batch(const mdt_tensor_set *in, const char *name, int ndim,
                               const int64_t *shape, mdt_arena *a, float **out);
/* The same, read-only and without a copy when the input is already F32 (the large activations:
 * checked in place, uploaded straight from the caller's buffer); other dtypes are converted. */
mdt_status mdt_input_f32_view(const mdt_tensor_set *in, const char *name, int ndim,
                              const int64_t *shape, mdt_arena *a, const float **out);
/* Element i of integer tensor t (I64, I32, I16, I8, U8) as int64 into *v: 1, or 0 for another
 * dtype (nothing written). */
int mdt_input_int_at(const mdt_tensor *t, int64_t i, int64_t *v);
/* Integer index input (I64/I32/I16/I8/U8) with every value in [lo, hi), as int64 in the arena. */
mdt_status mdt_input_i64(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         int64_t lo, int64_t hi, mdt_arena *a, int64_t **out);
/* Optional flag `name`: one BOOL or integer element (0-d or [1]), 0 or 1; absent: 0. */
mdt_status mdt_input_flag(const mdt_tensor_set *in, const char *name, int *flag);
/* Dimension `dim` of input `name`, or -1 when absent. */
int64_t mdt_input_dim(const mdt_tensor_set *in, const char *name, int dim);

/* ---- random inputs (`meshdit inputs`) ---- */
/* Adds F32 `name` of `shape` filled with N(0, 1) draws from `rng`, in order. */
mdt_status mdt_inputs_add_normal(mdt_tensor_set *out, const char *name, int ndim,
                                 const int64_t *shape, mdt_rng *rng);
/* Adds F32 `name` [n] with every element `value`; `*t` (optional) receives it. */
mdt_status mdt_inputs_add_const(mdt_tensor_set *out, const char *name, int64_t n, double value,
                                mdt_tensor **t);

#endif /* MDT_MODELS_INPUTS_H */
