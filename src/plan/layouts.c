/*
 * layouts.c — layout planning for a client (meshdit.h): device presets and the scaling model's
 * estimate (cost.h) of every tp x ring x ulysses layout of N devices, best first.
 */
#include "models/info.h"
#include "core/core.h"
#include "plan/cost.h"

#include <stdlib.h>
#include <string.h>

/* Valid layouts first, then by predicted step time. */
static int cmp_est(const void *a, const void *b) {
    const mdt_layout_estimate *x = a, *y = b;
    if (x->valid != y->valid)
        return y->valid - x->valid;
    return (x->t_step > y->t_step) - (x->t_step < y->t_step);
}

mdt_status mdt_plan_layouts(const mdt_model_info *info, const mdt_device_spec *dev, int devices,
                            int64_t tokens, int64_t txt_tokens, double elem_bytes,
                            mdt_layout_estimate **out, int *n) {
    *out = NULL, *n = 0;
    if (txt_tokens > tokens && !mdt_model_cross_attention(info->m))
        return MDT_FAIL(MDT_E_INVALID,
                        "%lld text tokens exceed the %lld-token sequence: the model's text is part "
                        "of its joint sequence (tokens count text and image rows)",
                        (long long)txt_tokens, (long long)tokens);
    mdt_layout_estimate *est = calloc(4096, sizeof *est); /* at most one per (T, R) pair */
    int k = 0;
    if (!est)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (long long T = 1; T <= devices; T++)
        for (long long R = 1; T * R <= devices; R++)
            if (devices % (T * R) == 0 && k < 4096) {
                est[k] = (mdt_layout_estimate){
                    .tp = (int)T, .ring = (int)R, .ulysses = (int)(devices / (T * R))};
                mdt_estimate_layout(info->m, tokens, txt_tokens, elem_bytes, dev, &est[k++]);
            }
    qsort(est, (size_t)k, sizeof *est, cmp_est);
    mdt_layout_estimate *fit = realloc(est, sizeof *est * (size_t)(k > 0 ? k : 1));
    *out = fit ? fit : est, *n = k;
    return MDT_OK;
}
