/*
 * compare.c — tensor comparison for a client (meshdit.h): the largest elementwise difference
 * of two tensors in f32 against the reference's magnitude, and their names in words.
 */
#include "core/core.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdlib.h>

mdt_status mdt_tensor_compare(const mdt_tensor *a, const mdt_tensor *b, mdt_tensor_diff *d) {
    *d = (mdt_tensor_diff){0};
    int same = a->ndim == b->ndim;
    for (int k = 0; same && k < a->ndim; k++)
        same = a->shape[k] == b->shape[k];
    if (!same || !mdt_dtype_is_float(a->dtype) || !mdt_dtype_is_float(b->dtype))
        return MDT_OK;
    d->comparable = 1;
    int64_t n = mdt_tensor_numel(a);
    float *fa = malloc(sizeof(float) * (size_t)(n ? n : 1)),
          *fb = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (!fa || !fb) {
        free(fa), free(fb);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    mdt_convert_to_f32(a->dtype, a->data, fa, n);
    mdt_convert_to_f32(b->dtype, b->data, fb, n);
    double maxd = 0, maxb = 0;
    int nonfinite = 0;
    for (int64_t j = 0; j < n; j++) {
        double x = fabs((double)fa[j] - fb[j]);
        nonfinite |= !isfinite(fa[j]) || !isfinite(fb[j]);
        maxd = x > maxd ? x : maxd;
        maxb = fabs(fb[j]) > maxb ? fabs(fb[j]) : maxb;
    }
    free(fa), free(fb);
    d->max_abs_diff = maxd, d->max_abs_b = maxb, d->nonfinite = nonfinite;
    return MDT_OK;
}

const char *mdt_dtype_str(mdt_dtype dt) { return mdt_dtype_name(dt); }

const char *mdt_tensor_shape_str(const mdt_tensor *t, char *buf, size_t cap) {
    return mdt_shape_str(t->ndim, t->shape, buf, cap);
}
