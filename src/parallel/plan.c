/* plan.c — shard maths of plan.h. */
#include "plan.h"

#include "core/testhooks.h"

const char *mdt_tp_style_name(mdt_tp_style s) {
    switch (s) {
    case MDT_TP_REPLICATED: return "replicated";
    case MDT_TP_COLWISE: return "colwise";
    case MDT_TP_ROWWISE: return "rowwise";
    case MDT_TP_PACKED_COLWISE: return "packed-colwise";
    case MDT_TP_PACKED_ROWWISE: return "packed-rowwise";
    case MDT_TP_REPLICATED_INPUT_ROWWISE: return "replicated-input-rowwise";
    }
    return "?";
}

int mdt_tp_shard_dim(mdt_tp_style s) {
    switch (s) {
    case MDT_TP_COLWISE:
    case MDT_TP_PACKED_COLWISE: return 0;
    case MDT_TP_ROWWISE:
    case MDT_TP_PACKED_ROWWISE:
    case MDT_TP_REPLICATED_INPUT_ROWWISE: return 1;
    case MDT_TP_REPLICATED: return -1;
    }
    return -1;
}

mdt_status mdt_shard_ranges(const mdt_weight_spec *w, int T, int k, int64_t *starts, int64_t *lens,
                            int *n) {
    int dim = mdt_tp_shard_dim(w->style);
    if (T < 1 || k < 0 || k >= T)
        return MDT_FAIL(MDT_E_INVALID, "%s: TP coordinate %d is outside degree %d", w->name, k, T);
    if (dim < 0 || T == 1) {
        starts[0] = 0;
        lens[0] = w->ndim > 0 ? w->shape[dim < 0 ? 0 : dim] : 1;
        *n = 1;
        return MDT_OK;
    }
    if (dim >= w->ndim)
        return MDT_FAIL(MDT_E_INVALID, "%s: style %s shards dim %d of a rank-%d tensor", w->name,
                        mdt_tp_style_name(w->style), dim, w->ndim);
    int nb = w->nblocks > 0 ? w->nblocks : 1;
    int64_t off = 0;
    for (int b = 0; b < nb; b++) {
        int64_t s = w->nblocks > 0 ? w->blocks[b] : w->shape[dim];
        if (s % T != 0 && !w->uneven)
            return MDT_FAIL(MDT_E_INVALID,
                            "tp=%d does not divide %s: block %d of dim %d has size %lld", T,
                            w->name, b, dim, (long long)s);
        if (s % T != 0 && s < T)
            return MDT_FAIL(MDT_E_INVALID,
                            "tp=%d exceeds %s: block %d of dim %d has size %lld (an uneven split "
                            "leaves no coordinate empty)",
                            T, w->name, b, dim, (long long)s);
        mdt_split_range(s, T, k, &starts[b], &lens[b]);
        if (s % T != 0 && mdt_test_hooks_get()->uneven_even_starts)
            starts[b] = (int64_t)k * (s / T); /* test seam: the naive split's overlap */
        starts[b] += off;
        off += s;
    }
    if (off != w->shape[dim])
        return MDT_FAIL(MDT_E_INVALID, "%s: blocks sum to %lld but dim %d is %lld", w->name,
                        (long long)off, dim, (long long)w->shape[dim]);
    *n = nb;
    return MDT_OK;
}

mdt_status mdt_shard_local_shape(const mdt_weight_spec *w, int T, int k, int64_t local[2]) {
    int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
    int n;
    MDT_TRY(mdt_shard_ranges(w, T, k, st, ln, &n));
    local[0] = w->ndim > 0 ? w->shape[0] : 1;
    local[1] = w->ndim > 1 ? w->shape[1] : 1;
    int dim = mdt_tp_shard_dim(w->style);
    if (dim >= 0 && T > 1) {
        int64_t sum = 0;
        for (int i = 0; i < n; i++)
            sum += ln[i];
        local[dim] = sum;
    }
    return MDT_OK;
}

int mdt_shard_uneven_at(const mdt_weight_spec *w, int T) {
    const int dim = mdt_tp_shard_dim(w->style);
    if (dim < 0 || dim >= w->ndim || T <= 1 || !w->uneven)
        return 0;
    for (int b = 0; b < (w->nblocks > 0 ? w->nblocks : 1); b++)
        if ((w->nblocks > 0 ? w->blocks[b] : w->shape[dim]) % T != 0)
            return 1;
    return 0;
}

int mdt_weight_stored_shape(const mdt_weight_spec *w, int64_t shape[MDT_MAX_DIMS]) {
    const int n = w->stored_ndim > 0 ? w->stored_ndim : w->ndim;
    for (int d = 0; d < n; d++)
        shape[d] = w->stored_ndim > 0 ? w->stored[d] : w->shape[d];
    return n;
}

void mdt_split_range(int64_t S, int P, int c, int64_t *start, int64_t *len) {
    int64_t base = S / P, extra = S % P;
    *len = base + (c < extra ? 1 : 0);
    *start = (int64_t)c * base + (c < extra ? c : extra);
}

const char *mdt_rows_name(mdt_rows r) {
    static const char *const n[] = {"unset", "none", "all", "image", "text", "one"};
    return (unsigned)r <= MDT_ROWS_ONE ? n[r] : "?";
}
