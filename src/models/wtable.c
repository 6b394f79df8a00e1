/*
 * wtable.c — a family's weight table: each checkpoint tensor's name, full shape, TP style and
 * where the loader binds its data (see family.h).
 */
#include "models/family.h"

#include <stdio.h>
#include <string.h>

mdt_status mdt_wtable_add(mdt_wtable *t, const char *name, int ndim, int64_t d0, int64_t d1,
                          mdt_tp_style style, const float **bind) {
    if (strlen(name) >= MDT_NAME_MAX)
        return MDT_FAIL(MDT_E_INVALID, "weight name too long: %s", name);
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        mdt_weight_spec *s = mdt_calloc(sizeof *s * (size_t)cap);
        const float ***b = mdt_calloc(sizeof *b * (size_t)cap);
        int *r = mdt_calloc(sizeof *r * (size_t)cap);
        mdt_lin **l = mdt_calloc(sizeof(mdt_lin *) * (size_t)cap);
        if (!s || !b || !r || !l) {
            mdt_free(s), mdt_free((void *)b), mdt_free(r), mdt_free((void *)l);
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        }
        if (t->n) {
            memcpy(s, t->specs, sizeof *s * (size_t)t->n);
            memcpy((void *)b, (const void *)t->bind, sizeof *b * (size_t)t->n);
            memcpy(r, t->required, sizeof *r * (size_t)t->n);
            memcpy((void *)l, (const void *)t->lin, sizeof(mdt_lin *) * (size_t)t->n);
        }
        mdt_free(t->specs), mdt_free((void *)t->bind), mdt_free(t->required);
        mdt_free((void *)t->lin);
        t->specs = s, t->bind = b, t->required = r, t->lin = l, t->cap = cap;
    }
    mdt_weight_spec *w = &t->specs[t->n];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    w->shape[0] = d0;
    w->shape[1] = ndim > 1 ? d1 : 0;
    w->style = style;
    w->rows = MDT_ROWS_NONE; /* a linear's weight gets the table's rows (mdt_wtable_add_linear) */
    t->bind[t->n] = bind;
    t->lin[t->n] = NULL;
    t->required[t->n] = 1;
    t->n++;
    return MDT_OK;
}

mdt_status mdt_wtable_add_linear(mdt_wtable *t, mdt_lin *l, const char *pfx, const char *name,
                                 int64_t out, int64_t in, mdt_tp_style style, int bias) {
    char nm[2 * MDT_NAME_MAX + 16]; /* mdt_wtable_add refuses names longer than MDT_NAME_MAX */
    l->in = in, l->out = out, l->b = NULL, l->wh = NULL;
    snprintf(nm, sizeof nm, "%s%s.weight", pfx, name);
    MDT_TRY(mdt_wtable_add(t, nm, 2, out, in, style, &l->w));
    t->lin[t->n - 1] = l;
    t->specs[t->n - 1].rows = t->rows;
    if (!bias)
        return MDT_OK;
    snprintf(nm, sizeof nm, "%s%s.bias", pfx, name);
    return mdt_wtable_add(t, nm, 1, out, 0,
                          mdt_tp_shard_dim(style) == 0 ? style : MDT_TP_REPLICATED, &l->b);
}

mdt_rows mdt_wtable_rows(mdt_wtable *t, mdt_rows rows) {
    const mdt_rows prev = t->rows;
    t->rows = rows;
    return prev;
}

mdt_status mdt_wtable_check(const mdt_wtable *t) {
    for (int i = 0; i < t->n; i++)
        if (t->lin[i] && t->specs[i].rows == MDT_ROWS_UNSET)
            return MDT_FAIL(MDT_E_INVALID,
                            "weight table: linear '%s' declares no rows (mdt_wtable_rows)",
                            t->specs[i].name);
    return MDT_OK;
}

mdt_status mdt_wtable_add_vector(mdt_wtable *t, const float **v, const char *pfx, const char *name,
                                 int64_t n) {
    char nm[2 * MDT_NAME_MAX];
    snprintf(nm, sizeof nm, "%s%s", pfx, name);
    return mdt_wtable_add(t, nm, 1, n, 0, MDT_TP_REPLICATED, v);
}

mdt_status mdt_wtable_set_stored_shape(mdt_wtable *t, int i, int ndim, const int64_t *shape) {
    mdt_weight_spec *w = i >= 0 && i < t->n ? &t->specs[i] : NULL;
    int64_t rest = 1;
    for (int d = 1; w && d < ndim && ndim <= MDT_MAX_DIMS; d++)
        rest *= shape[d];
    if (!w || w->ndim != 2 || ndim < 3 || ndim > MDT_MAX_DIMS || shape[0] != w->shape[0] ||
        rest != w->shape[1])
        return MDT_FAIL(MDT_E_INVALID, "weight table: tensor %d cannot be stored as %d dims", i,
                        ndim);
    w->stored_ndim = ndim;
    memcpy(w->stored, shape, sizeof(int64_t) * (size_t)ndim);
    return MDT_OK;
}

void mdt_wtable_set_uneven(mdt_wtable *t, int first) {
    for (int i = first < 0 ? 0 : first; i < t->n; i++)
        t->specs[i].uneven = mdt_tp_shard_dim(t->specs[i].style) >= 0;
}

void mdt_wtable_free(mdt_wtable *t) {
    mdt_free((void *)t->lin);
    mdt_free(t->specs);
    mdt_free((void *)t->bind);
    mdt_free(t->required);
    memset(t, 0, sizeof *t);
}

mdt_status mdt_cfg_check_dims(const char *family, const int64_t *dims, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (dims[i] > MDT_MAX_DIM)
            return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: a %s size of %lld exceeds %lld",
                            family, (long long)dims[i], (long long)MDT_MAX_DIM);
    return MDT_OK;
}
