/*
 * shard.c — see shard.h.
 */
#include "parallel/shard.h"

#include <string.h>

void mdt_shard_copy(const mdt_weight_spec *w, int T, int k, float *full, float *local,
                    int to_local) {
    int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
    int n;
    if (mdt_shard_ranges(w, T, k, st, ln, &n) != MDT_OK)
        return; /* callers check the layout first */
    const int dim = T > 1 ? mdt_tp_shard_dim(w->style) : -1;
    const int64_t rows = w->shape[0], cols = w->ndim > 1 ? w->shape[1] : 1;
    if (dim < 0) {
        if (to_local)
            memcpy(local, full, sizeof(float) * (size_t)(rows * cols));
        else
            memcpy(full, local, sizeof(float) * (size_t)(rows * cols));
        return;
    }
    if (dim == 0) { /* whole rows: one contiguous run per block */
        int64_t off = 0;
        for (int b = 0; b < n; b++) {
            float *f = full + st[b] * cols, *l = local + off * cols;
            size_t bytes = sizeof(float) * (size_t)(ln[b] * cols);
            if (to_local)
                memcpy(l, f, bytes);
            else
                memcpy(f, l, bytes);
            off += ln[b];
        }
        return;
    }
    int64_t lcols = 0;
    for (int b = 0; b < n; b++)
        lcols += ln[b];
    for (int64_t r = 0; r < rows; r++) { /* dim 1: per row, one piece per block */
        int64_t off = 0;
        for (int b = 0; b < n; b++) {
            float *f = full + r * cols + st[b], *l = local + r * lcols + off;
            if (to_local)
                memcpy(l, f, sizeof(float) * (size_t)ln[b]);
            else
                memcpy(f, l, sizeof(float) * (size_t)ln[b]);
            off += ln[b];
        }
    }
}
