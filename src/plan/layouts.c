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

/* A guided step on cfg x (tp x ring x ulysses): with cfg 1 both branches in turn (twice the
 * forward), with cfg 2 one branch per group and one exchange of the prediction (an all-gather
 * over the cfg axis: each group's latent rows x out features). */
static void add_guidance(const mdt_model *m, const mdt_device_spec *dev, int devices, int64_t S,
                         int64_t L, double b, mdt_layout_estimate *e) {
    if (e->cfg == 1) {
        e->flops_linear *= 2, e->flops_attn *= 2, e->flops_other *= 2;
        e->bytes_tp *= 2, e->bytes_ulysses *= 2, e->bytes_ring *= 2, e->bytes_cp *= 2;
        e->t_compute *= 2, e->t_comm *= 2, e->t_step *= 2;
        return;
    }
    const mdt_model_dims md = mdt_model_dims_of(m);
    const int64_t rows = mdt_model_cross_attention(m) || L < 0 || L > S ? S : S - L;
    e->bytes_cfg = (double)rows * (double)md.out * b; /* each group's prediction, sent once */
    const double t =
        mdt_plan_coll_seconds(dev, MDT_COST_ALLGATHER, devices > dev->node_size, 1, e->bytes_cfg);
    e->t_comm += t, e->t_step += t;
}

mdt_status mdt_plan_layouts(const mdt_model_info *info, const mdt_device_spec *dev,
                            const mdt_plan_request *rq, mdt_layout_estimate **out, int *n) {
    *out = NULL, *n = 0;
    const int devices = rq->devices;
    const int64_t tokens = rq->tokens, txt_tokens = rq->txt_tokens;
    if (txt_tokens >= tokens && !mdt_model_cross_attention(info->m)) /* no image row left */
        return MDT_FAIL(MDT_E_INVALID,
                        "%lld text tokens leave no image row of the %lld-token sequence: the "
                        "model's text is part of its joint sequence (tokens count text and image "
                        "rows)",
                        (long long)txt_tokens, (long long)tokens);
    mdt_layout_estimate *est = calloc(8192, sizeof *est); /* at most one per (C, T, R) */
    int k = 0;
    if (!est)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    /* cfg 2 runs one branch per group: only for a family whose pipeline has two (a guided run of
     * any other is refused, so a cfg 2 layout of it would be a plan that cannot run) */
    const int max_cfg = rq->guided && mdt_model_guides(info->m) ? 2 : 1;
    for (int C = 1; C <= max_cfg; C++) {
        if (devices % C)
            continue;
        const long long inner = devices / C;
        for (long long T = 1; T <= inner; T++)
            for (long long R = 1; T * R <= inner; R++)
                if (inner % (T * R) == 0 && k < 8192) {
                    mdt_layout_estimate *e = &est[k++];
                    *e = (mdt_layout_estimate){
                        .tp = (int)T, .ring = (int)R, .ulysses = (int)(inner / (T * R))};
                    mdt_estimate_layout(info->m, tokens, txt_tokens, rq->elem_bytes, dev, e);
                    e->cfg = C;
                    if (rq->guided && e->valid)
                        add_guidance(info->m, dev, devices, tokens, txt_tokens, rq->elem_bytes, e);
                }
    }
    qsort(est, (size_t)k, sizeof *est, cmp_est);
    mdt_layout_estimate *fit = realloc(est, sizeof *est * (size_t)(k > 0 ? k : 1));
    *out = fit ? fit : est, *n = k;
    return MDT_OK;
}
