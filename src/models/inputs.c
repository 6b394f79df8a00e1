/*
 * inputs.c — see inputs.h.
 */
#include "models/inputs.h"

#include "io/safetensors.h"

#include <stdint.h>
#include <string.h>

/* Whether t has shape `shape` (-1 = any). */
static int has_shape(const mdt_tensor *t, int ndim, const int64_t *shape) {
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = shape[i] < 0 || t->shape[i] == shape[i];
    return same;
}

static mdt_status input_tensor(const mdt_tensor_set *in, const char *name, int ndim,
                               const int64_t *shape, const mdt_tensor **out) {
    char s1[96], s2[96];
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    if (!t)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' is missing (the model needs it)", name);
    if (t->ndim != ndim) /* the sizes the caller expects may come from this very tensor */
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: tensor '%s' has shape %s (%d dims), expected %d dims", name,
                        mdt_shape_str(t->ndim, t->shape, s1, 96), t->ndim, ndim);
    if (!has_shape(t, ndim, shape))
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' has shape %s, expected %s", name,
                        mdt_shape_str(t->ndim, t->shape, s1, 96),
                        mdt_shape_str(ndim, shape, s2, 96));
    *out = t;
    return MDT_OK;
}

static mdt_status check_finite(const char *name, const float *v, int64_t n) {
    const int64_t i = mdt_first_nonfinite(v, n);
    if (i >= 0)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' holds a NaN or Inf at element %lld",
                        name, (long long)i);
    return MDT_OK;
}

mdt_status mdt_input_f32(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         mdt_arena *a, float **out) {
    const mdt_tensor *t;
    MDT_TRY(input_tensor(in, name, ndim, shape, &t));
    if (t->dtype == MDT_BOOL)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' has dtype BOOL, expected a number",
                        name);
    const int64_t n = mdt_tensor_numel(t);
    *out = mdt_arena_floats(a, n);
    if (!*out)
        return MDT_E_NOMEM;
    /* an input is any number dtype (a timestep, ids, a mask as torch hands them) */
    if (mdt_convert_number_to_f32(t->dtype, t->data, *out, n) != MDT_OK)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: tensor '%s' has dtype %s, which cannot be read as a number "
                        "(expected F32, BF16, F16, F64, I64, I32, I16, I8 or U8)",
                        name, mdt_dtype_name(t->dtype));
    return check_finite(name, *out, n);
}

mdt_status mdt_input_f32_batch(const mdt_tensor_set *in, const char *name, int ndim,
                               const int64_t *shape, mdt_arena *a, float **out) {
    char s1[96], s2[96], s3[96];
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    int64_t one[MDT_MAX_DIMS];
    memcpy(one, shape, sizeof(int64_t) * (size_t)ndim);
    one[0] = 1;
    if (!t || shape[0] == 1 || has_shape(t, ndim, shape))
        return mdt_input_f32(in, name, ndim, shape, a, out);
    if (!has_shape(t, ndim, one))
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: tensor '%s' has shape %s, expected %s or %s (one value for the "
                        "whole batch)",
                        name, mdt_shape_str(t->ndim, t->shape, s1, 96),
                        mdt_shape_str(ndim, shape, s2, 96), mdt_shape_str(ndim, one, s3, 96));
    float *v;
    MDT_TRY(mdt_input_f32(in, name, ndim, one, a, &v));
    const int64_t n = mdt_tensor_numel(t); /* one sample's values, repeated over the batch */
    *out = mdt_arena_floats(a, shape[0] * n);
    if (!*out)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < shape[0]; b++)
        memcpy(*out + b * n, v, sizeof(float) * (size_t)n);
    return MDT_OK;
}

mdt_status mdt_input_f32_view(const mdt_tensor_set *in, const char *name, int ndim,
                              const int64_t *shape, mdt_arena *a, const float **out) {
    const mdt_tensor *t;
    MDT_TRY(input_tensor(in, name, ndim, shape, &t));
    if (t->dtype != MDT_F32) {
        float *conv;
        MDT_TRY(mdt_input_f32(in, name, ndim, shape, a, &conv));
        *out = conv;
        return MDT_OK;
    }
    const float *v = t->data;
    MDT_TRY(check_finite(name, v, mdt_tensor_numel(t)));
    *out = v;
    return MDT_OK;
}

int mdt_input_int_at(const mdt_tensor *t, int64_t i, int64_t *v) {
    switch (t->dtype) {
    case MDT_I64: *v = ((const int64_t *)t->data)[i]; return 1;
    case MDT_I32: *v = ((const int32_t *)t->data)[i]; return 1;
    case MDT_I16: *v = ((const int16_t *)t->data)[i]; return 1;
    case MDT_I8:
        *v = (int64_t)(int)((const int8_t *)t->data)[i]; /* NOLINT(bugprone-signed-char-misuse) */
        return 1;
    case MDT_U8: *v = ((const uint8_t *)t->data)[i]; return 1;
    default: return 0;
    }
}

mdt_status mdt_input_i64(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         int64_t lo, int64_t hi, mdt_arena *a, int64_t **out) {
    const mdt_tensor *t;
    MDT_TRY(input_tensor(in, name, ndim, shape, &t));
    const int64_t n = mdt_tensor_numel(t);
    int64_t *v = (int64_t *)(void *)mdt_arena_floats(a, 2 * n);
    if (!v)
        return MDT_E_NOMEM;
    for (int64_t i = 0; i < n; i++) {
        if (!mdt_input_int_at(t, i, &v[i]))
            return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' has dtype %s, expected integers",
                            name, mdt_dtype_name(t->dtype));
        if (v[i] < lo || v[i] >= hi)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: tensor '%s' element %lld is %lld, outside [%lld, %lld)", name,
                            (long long)i, (long long)v[i], (long long)lo, (long long)hi);
    }
    *out = v;
    return MDT_OK;
}

mdt_status mdt_input_flag(const mdt_tensor_set *in, const char *name, int *flag) {
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    int64_t v = 0;
    *flag = 0;
    if (!t)
        return MDT_OK;
    if (mdt_tensor_numel(t) != 1 || t->ndim > 1 ||
        (t->dtype != MDT_BOOL && !mdt_input_int_at(t, 0, &v)))
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: tensor '%s' must be one BOOL or integer element (0 or 1)", name);
    if (t->dtype == MDT_BOOL)
        v = ((const uint8_t *)t->data)[0] != 0;
    if (v != 0 && v != 1)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' is %lld; it is a flag, 0 or 1", name,
                        (long long)v);
    *flag = (int)v;
    return MDT_OK;
}

int64_t mdt_input_dim(const mdt_tensor_set *in, const char *name, int dim) {
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    return t && t->ndim > dim ? t->shape[dim] : -1;
}

mdt_status mdt_inputs_add_normal(mdt_tensor_set *out, const char *name, int ndim,
                                 const int64_t *shape, mdt_rng *rng) {
    mdt_tensor *t;
    MDT_TRY(mdt_tensor_set_add(out, name, MDT_F32, ndim, shape, &t));
    float *d = t->data;
    for (int64_t i = 0; i < mdt_tensor_numel(t); i++)
        d[i] = (float)mdt_rng_normal(rng);
    return MDT_OK;
}

mdt_status mdt_inputs_add_const(mdt_tensor_set *out, const char *name, int64_t n, double value,
                                mdt_tensor **t) {
    mdt_tensor *v;
    MDT_TRY(mdt_tensor_set_add(out, name, MDT_F32, 1, &n, &v));
    for (int64_t i = 0; i < n; i++)
        ((float *)v->data)[i] = (float)value;
    if (t)
        *t = v;
    return MDT_OK;
}
