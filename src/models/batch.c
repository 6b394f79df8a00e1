/*
 * batch.c — a forward's inputs cut by batch rows: what the cfg axis splits between its two groups
 * when a step has no second branch (the sampler's split, branches.c; the server's, serve.c).
 * The family's input declarations say which inputs carry the batch in dim 0 (MDT_IN_BATCH) and
 * which may hold one value for the whole batch instead (MDT_IN_SHARED, dim 0 of 1).
 */
#include "models/model.h"

#include <string.h>

int mdt_input_shared_by_batch(const mdt_input_decl *d, const mdt_tensor *t, int64_t B) {
    return d && (d->flags & MDT_IN_BATCH) && (d->flags & MDT_IN_SHARED) &&
           (t->ndim == 0 || t->shape[0] == 1) && B > 1; /* [1, ...], or one value (0-d) */
}

int64_t mdt_model_batch_of(const mdt_model *m, const mdt_tensor_set *in) {
    const mdt_tensor *lat = mdt_tensor_set_get(in, m->fam->latent_input);
    const int64_t B = lat && lat->ndim >= 1 ? lat->shape[0] : 0;
    int batched = 0;
    for (int i = 0; i < mdt_tensor_set_count(in); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
        const mdt_input_decl *d = mdt_model_input(m, name);
        if (!d || !(d->flags & MDT_IN_BATCH))
            continue;
        batched = 1;
        if ((t->ndim < 1 || t->shape[0] != B) && !mdt_input_shared_by_batch(d, t, B))
            return 0;
    }
    return batched && B >= 2 ? B : 0;
}

mdt_status mdt_model_inputs_rows(const mdt_model *m, const mdt_tensor_set *in, int64_t B,
                                 int64_t b0, int64_t nb, mdt_tensor_set **out) {
    mdt_tensor_set *s = NULL;
    MDT_TRY(mdt_tensor_set_create(&s));
    mdt_status st = MDT_OK;
    for (int i = 0; i < mdt_tensor_set_count(in) && st == MDT_OK; i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
        const mdt_input_decl *d = mdt_model_input(m, name);
        if (d && (d->flags & MDT_IN_BATCH) && t->ndim >= 1 && !mdt_input_shared_by_batch(d, t, B)) {
            mdt_tensor part = *t; /* rows b0.. of dim 0 */
            const int64_t row = t->shape[0] > 0 ? mdt_tensor_nbytes(t) / t->shape[0] : 0;
            part.shape[0] = nb;
            part.data = (char *)t->data + b0 * row;
            st = mdt_tensor_set_add_copy(s, name, &part);
        } else {
            st = mdt_tensor_set_add_copy(s, name, t);
        }
    }
    if (st != MDT_OK) {
        mdt_tensor_set_free(s);
        return st;
    }
    *out = s;
    return MDT_OK;
}
