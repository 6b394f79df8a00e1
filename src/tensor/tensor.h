/*
 * tensor.h — dtypes (names, sizes, conversion to and from f32) and the owning named tensor set.
 *
 * Conversions are exact for widening (bf16/f16 -> f32) and round-to-nearest-even for narrowing
 * (f32 -> bf16/f16), matching torch's .to(). No I/O and no kernels here.
 */
#ifndef MDT_TENSOR_H
#define MDT_TENSOR_H

#include "core/core.h"

/* Size in bytes of one element; 0 for an invalid dtype. */
size_t mdt_dtype_size(mdt_dtype dt);
/* safetensors name ("F32", "BF16", ...). */
const char *mdt_dtype_name(mdt_dtype dt);
/* Parses a safetensors dtype name; returns MDT_DTYPE_COUNT for unknown names. */
mdt_dtype mdt_dtype_parse(const char *name);
/* Whether the dtype is a float type meshdit converts to f32 (F32, F16, BF16, F64). */
int mdt_dtype_is_float(mdt_dtype dt);

float mdt_bf16_to_f32(uint16_t h);
uint16_t mdt_f32_to_bf16(float f);
float mdt_f16_to_f32(uint16_t h);
uint16_t mdt_f32_to_f16(float f);

/* Converts n elements of `src` (dtype dt, little-endian) into f32 `dst`.
 * MDT_E_UNSUPPORTED for a non-float dtype. */
mdt_status mdt_convert_to_f32(mdt_dtype dt, const void *src, float *dst, int64_t n);
/* Converts n f32 values into dtype dt (F32, F16, BF16). */
mdt_status mdt_convert_from_f32(mdt_dtype dt, const float *src, void *dst, int64_t n);

/* Formats a shape as "[2, 3, 4]" into buf. */
const char *mdt_shape_str(int ndim, const int64_t *shape, char *buf, size_t cap);

/* Adds a copy of `t` (any dtype) as `name`. */
mdt_status mdt_tensor_set_add_copy(mdt_tensor_set *set, const char *name, const mdt_tensor *t);
/* mdt_convert_to_f32 and the small integers (I16, I8, U8) too: a number given as an input (a
 * timestep, ids, a mask), never a weight (an I8 or U8 weight is a quantized one, whose reader
 * scales it). BOOL: MDT_E_UNSUPPORTED. */
mdt_status mdt_convert_number_to_f32(mdt_dtype dt, const void *src, float *dst, int64_t n);
/* Converts tensor `t` of `set` to F32 in place (its data replaced; nothing when already F32),
 * from any dtype mdt_convert_number_to_f32 reads. MDT_E_UNSUPPORTED (set untouched) or
 * MDT_E_NOMEM. */
mdt_status mdt_tensor_set_to_f32(mdt_tensor_set *set, mdt_tensor *t);

#endif /* MDT_TENSOR_H */
