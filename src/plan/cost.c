/* cost.c — see cost.h: FLOPs, bytes per axis and step time of a layout. */
#include "plan/cost.h"
#include "plan/memory.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

double mdt_plan_coll_seconds(const mdt_device *dev, mdt_coll_cost_kind kind, int inter,
                             double calls, double bytes) {
    if (calls <= 0)
        return 0;
    const mdt_link_cost *c = &dev->coll[inter ? MDT_LINK_INTER : MDT_LINK_INTRA][kind];
    if (c->bw > 0)
        return calls * c->latency + bytes / c->bw;
    return calls * dev->latency + bytes / (inter ? dev->bw_inter : dev->bw_intra);
}

void mdt_estimate_layout(const mdt_model *m, int64_t S, int64_t L, double b, const mdt_device *dev,
                         mdt_layout_estimate *e) {
    const int T = e->tp, R = e->ring, U = e->ulysses;
    *e = (mdt_layout_estimate){.tp = T, .ring = R, .ulysses = U};
    if (mdt_model_check_layout(m, T, R, U) != MDT_OK) {
        snprintf(e->why, sizeof e->why, "%s", mdt_last_error());
        mdt_error_clear();
        return;
    }
    const mdt_model_dims md = mdt_model_dims_of(m);
    const double A = (double)(md.heads * md.head_dim), D = (double)md.hidden;
    const double P = (double)R * U, s = (double)S / P; /* local rows */
    /* a model with cross-attention keeps its text (encoder) rows whole on every rank; a joint
     * model's text rows are part of the S it splits */
    const int cross = mdt_model_cross_attention(m);
    const double Lt = L < 0 ? 0 : (double)(L > S && !cross ? S : L);
    const double txt = cross ? Lt : Lt / P;
    double weights = 0, n_rowwise = 0, rows_ar = 0, elementwise = 0, n_cond = 0, cond_out = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, 0, loc); /* coordinate 0: the largest */
        weights += (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0) * b;
        /* the AdaLN projections of the conditioning (one row per sample, ~no FLOPs): under TP
         * an all-reduce of this CP rank's slice of the outputs, under CP an all-gather of them */
        if (w->ndim == 2 && w->rows == MDT_ROWS_ONE &&
            w->style == MDT_TP_REPLICATED_INPUT_ROWWISE) {
            n_cond += 1, cond_out += (double)w->shape[0];
            if (T > 1)
                n_rowwise += 1, rows_ar += (double)w->shape[0] / P;
        }
        /* the rows each linear runs on, as its family declared them: the conditioning and
         * tensors that are no linear's weight count none */
        if (w->ndim != 2 || w->rows == MDT_ROWS_ONE || w->rows == MDT_ROWS_NONE)
            continue;
        const double rows = w->rows == MDT_ROWS_TEXT    ? txt
                            : w->rows == MDT_ROWS_IMAGE ? (cross ? s : s - txt)
                                                        : s;
        const double p = (double)w->shape[0] * (double)w->shape[1];
        const int sharded = w->style != MDT_TP_REPLICATED;
        /* an uneven split: the largest shard's, which the other ranks wait for */
        const double pl = mdt_shard_uneven_at(w, T) ? (double)loc[0] * (double)loc[1]
                          : sharded                 ? p / T
                                                    : p;
        e->flops_linear += 2.0 * rows * pl;
        elementwise += rows * (double)loc[0];
        if (T > 1 && (w->style == MDT_TP_ROWWISE || w->style == MDT_TP_PACKED_ROWWISE ||
                      w->style == MDT_TP_REPLICATED_INPUT_ROWWISE)) {
            n_rowwise += 1; /* one all-reduce of its output rows (reduce-scatter + all-gather) */
            rows_ar += rows * (double)w->shape[0];
        }
    }
    /* the attention calls of a forward, as the family counts them */
    const double n_attn = (double)md.self_attn, n_cross = (double)md.cross_attn;
    const double n_text_attn = (double)md.text_attn;
    /* self-attention: local queries x all keys over the local heads; cross-attention: local
     * queries x the text keys; a text refiner: text x text */
    e->weight_bytes = weights;
    e->flops_attn = 4.0 * (double)S * (double)S * A * n_attn / (T * P) +
                    4.0 * s * Lt * A * n_cross / T + 4.0 * Lt * Lt * A * n_text_attn / T;
    e->flops_other = 8.0 * elementwise; /* norms, gates, activations: ~8 per output element */
    /* per attention block: the TP all-reduces of rowwise outputs; Ulysses q, k, v in and out; ring
     * K and V of the other blocks; one output gather */
    e->bytes_tp = T > 1 ? 2.0 * (T - 1) / T * rows_ar * b : 0;
    e->bytes_ulysses = U > 1 ? n_attn * 4.0 * (U - 1) / U * s * (A / T) * b : 0;
    e->bytes_ring = R > 1 ? n_attn * 2.0 * (R - 1) * ((double)S / R) * (A / (T * U)) * b : 0;
    e->bytes_cp = P > 1 ? (P - 1) * s * D * b : 0;
    const double bytes_cond = P > 1 ? (P - 1) / P * cond_out * b : 0;
    e->act_bytes = mdt_act_bytes(m, T, R, U, 1, S, b);
    /* placement: tp innermost on a node, then ulysses, then ring (only what exceeds a node
     * crosses it) */
    const int node = dev->node_size;
    const int x_tp = T > node, x_u = T * U > node, x_r = T * U * R > node;
    const double f_attn = dev->flops_attn > 0 ? dev->flops_attn : dev->flops;
    const double t_attn = e->flops_attn / f_attn;
    e->t_compute = e->flops_linear / dev->flops + t_attn +
                   (dev->flops_other > 0 ? e->flops_other / dev->flops_other : 0);
    const double t_ring = mdt_plan_coll_seconds(dev, MDT_COST_SENDRECV, x_r,
                                                R > 1 ? n_attn * (R - 1.0) : 0, e->bytes_ring);
    /* the ring's next block travels while this one is attended, as far as the transport moves
     * data while no MPI call runs (measured: overlap; a preset assumes all of it) */
    const mdt_link_cost *rc = &dev->coll[x_r ? MDT_LINK_INTER : MDT_LINK_INTRA][MDT_COST_SENDRECV];
    const double hide = rc->bw > 0 ? rc->overlap : 1.0;
    e->t_comm =
        mdt_plan_coll_seconds(dev, MDT_COST_ALLREDUCE, x_tp, n_rowwise, e->bytes_tp) +
        mdt_plan_coll_seconds(dev, MDT_COST_ALLTOALL, x_u, U > 1 ? n_attn * 4.0 : 0,
                              e->bytes_ulysses) +
        t_ring - hide * fmin(t_ring, t_attn) +
        mdt_plan_coll_seconds(dev, MDT_COST_ALLGATHER, x_r || x_u, P > 1 ? 1 : 0, e->bytes_cp) +
        mdt_plan_coll_seconds(dev, MDT_COST_ALLGATHER, x_r || x_u, P > 1 ? n_cond : 0, bytes_cond);
    e->bytes_cp += bytes_cond;
    e->t_step = e->t_compute + e->t_comm;
    if (e->weight_bytes + e->act_bytes > dev->mem_bytes) {
        snprintf(e->why, sizeof e->why,
                 "needs %.1f GiB per device (weights %.1f + activations %.1f), over %.1f GiB",
                 (e->weight_bytes + e->act_bytes) / 1073741824.0, e->weight_bytes / 1073741824.0,
                 e->act_bytes / 1073741824.0, dev->mem_bytes / 1073741824.0);
        return;
    }
    e->valid = 1;
}
