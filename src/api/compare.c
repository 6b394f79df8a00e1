/*
 * compare.c — tensor comparison for a client (meshdit.h): the largest elementwise difference
 * of two tensors (float with float, in each one's own precision; integer or bool with integer or
 * bool, exactly) against the reference's magnitude, and their names in words.
 */
#include "core/core.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Integer dtypes (and bool): compared exactly, never through a float of fewer bits. */
static int is_int(mdt_dtype dt) {
    return dt == MDT_I64 || dt == MDT_I32 || dt == MDT_I16 || dt == MDT_I8 || dt == MDT_U8 ||
           dt == MDT_BOOL;
}

/* Element j of t as a long double: exact for every dtype here (int64 included, 64-bit
 * mantissa on x86; elsewhere as exact as the platform's long double). */
static long double elem(const mdt_tensor *t, int64_t j) {
    const void *p = t->data;
    switch (t->dtype) {
    case MDT_F32: return ((const float *)p)[j];
    case MDT_F16: return mdt_f16_to_f32(((const uint16_t *)p)[j]);
    case MDT_BF16: return mdt_bf16_to_f32(((const uint16_t *)p)[j]);
    case MDT_F64: return ((const double *)p)[j];
    case MDT_I64: return (long double)((const int64_t *)p)[j];
    case MDT_I32: return ((const int32_t *)p)[j];
    case MDT_I16: return ((const int16_t *)p)[j];
    case MDT_I8: return ((const int8_t *)p)[j];
    case MDT_U8:
    case MDT_BOOL: return ((const uint8_t *)p)[j];
    default: return 0;
    }
}

mdt_status mdt_tensor_compare(const mdt_tensor *a, const mdt_tensor *b, mdt_tensor_diff *d) {
    *d = (mdt_tensor_diff){0};
    int same = a->ndim == b->ndim;
    for (int k = 0; same && k < a->ndim; k++)
        same = a->shape[k] == b->shape[k];
    const int floats = mdt_dtype_is_float(a->dtype) && mdt_dtype_is_float(b->dtype);
    if (!same || !(floats || (is_int(a->dtype) && is_int(b->dtype))))
        return MDT_OK;
    d->comparable = 1;
    const int64_t n = mdt_tensor_numel(a);
    long double maxd = 0, maxb = 0;
    int nonfinite = 0;
    for (int64_t j = 0; j < n; j++) { /* in each side's own precision: F64 stays F64 */
        const long double x = elem(a, j), y = elem(b, j);
        nonfinite |= !isfinite((double)x) || !isfinite((double)y);
        const long double dd = fabsl(x - y);
        maxd = dd > maxd ? dd : maxd;
        maxb = fabsl(y) > maxb ? fabsl(y) : maxb;
    }
    d->max_abs_diff = (double)maxd, d->max_abs_b = (double)maxb, d->nonfinite = nonfinite;
    return MDT_OK;
}

const char *mdt_dtype_str(mdt_dtype dt) { return mdt_dtype_name(dt); }

const char *mdt_tensor_shape_str(const mdt_tensor *t, char *buf, size_t cap) {
    return mdt_shape_str(t->ndim, t->shape, buf, cap);
}
