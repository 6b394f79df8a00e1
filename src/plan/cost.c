/* cost.c — see cost.h: FLOPs, bytes per axis and step time of a layout. */
#include "plan/cost.h"
#include "plan/memory.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- which rows a weight runs on ---- */

typedef enum { ROWS_ALL = 0, ROWS_TEXT, ROWS_ONE } rows_class;

static int has(const char *name, const char *const *subs) {
    for (; *subs; subs++)
        if (strstr(name, *subs))
            return 1;
    return 0;
}

/* By diffusers' names, shared by the families: the conditioning embedders run on one row per
 * sample, the text stream's projections (MMDiT context stream, text embedders and refiners,
 * cross-attention keys and values) on the text tokens, everything else on all tokens. */
static rows_class rows_of(const mdt_weight_spec *w) {
    static const char *const k_one[] = {"time_text_embed.", "time_guidance_embed.",
                                        "condition_embedder.time_", "time_embedder.", NULL};
    static const char *const k_text[] = {"context_embedder",
                                         "add_q_proj",
                                         "add_k_proj",
                                         "add_v_proj",
                                         "to_add_out",
                                         "ff_context.",
                                         "txt_in",
                                         "txt_mlp.",
                                         "condition_embedder.text_embedder",
                                         "condition_embedder.image_",
                                         "attn2.to_k",
                                         "attn2.to_v",
                                         "token_refiner.",
                                         NULL};
    if (w->style == MDT_TP_REPLICATED_INPUT_ROWWISE || has(w->name, k_one))
        return ROWS_ONE;
    return has(w->name, k_text) ? ROWS_TEXT : ROWS_ALL;
}

/* Length of the block prefix of `name` ("transformer_blocks.3." of
 * "transformer_blocks.3.ff.net.0.proj.weight"): through the first ".<digits>." component; 0 if
 * none. */
static size_t block_prefix(const char *name) {
    for (const char *p = strchr(name, '.'); p; p = strchr(p + 1, '.')) {
        const char *q = p + 1;
        while (*q >= '0' && *q <= '9')
            q++;
        if (q > p + 1 && *q == '.')
            return (size_t)(q - name) + 1;
    }
    return 0;
}

/* For each weight of the table: 1 if it belongs to a block that also holds text-stream weights
 * (an MMDiT dual-stream block, whose other weights then run on the image rows only). The weights
 * of a block are contiguous in the table. */
static void dual_stream_blocks(const mdt_wtable *t, unsigned char *dual) {
    for (int i = 0; i < t->n;) {
        const size_t len = block_prefix(t->specs[i].name);
        int j = i + 1, text = 0;
        while (j < t->n && len && block_prefix(t->specs[j].name) == len &&
               strncmp(t->specs[j].name, t->specs[i].name, len) == 0)
            j++;
        for (int k = i; k < j; k++)
            text |= len && t->specs[k].ndim == 2 && rows_of(&t->specs[k]) == ROWS_TEXT;
        for (int k = i; k < j; k++)
            dual[k] = (unsigned char)text;
        i = j;
    }
}

static int ends_with(const char *name, const char *suffix) {
    const size_t len = strlen(name), n = strlen(suffix);
    return len >= n && strcmp(name + len - n, suffix) == 0;
}

/* Whether weight `name` is the query projection of a self-attention block: a separate to_q
 * (attn: Flux, H3, Qwen-Image; attn1: Wan), or a fused projection that holds the query (Flux.2's
 * single blocks: attn.to_qkv_mlp_proj). */
static int is_query_proj(const char *name) {
    return ends_with(name, "attn.to_q.weight") || ends_with(name, "attn1.to_q.weight") ||
           ends_with(name, "attn.to_qkv_mlp_proj.weight");
}

/* Seconds of `calls` collectives of `kind` sending `bytes` per rank over the inter-node link or
 * not: the measured cost where the spec has it, else the flat bandwidth and latency. */
static double coll_s(const mdt_device *dev, mdt_coll_cost_kind kind, int inter, double calls,
                     double bytes) {
    if (calls <= 0)
        return 0;
    const mdt_link_cost *c = &dev->coll[inter ? MDT_LINK_INTER : MDT_LINK_INTRA][kind];
    if (c->bw > 0)
        return calls * c->latency + bytes / c->bw;
    return calls * dev->latency + bytes / (inter ? dev->bw_inter : dev->bw_intra);
}

void mdt_estimate_layout(const mdt_model *m, int T, int R, int U, int64_t S, int64_t L, double b,
                         const mdt_device *dev, mdt_estimate *e) {
    memset(e, 0, sizeof *e);
    e->T = T, e->R = R, e->U = U;
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
    double weights = 0, n_rowwise = 0, rows_ar = 0, elementwise = 0;
    int n_attn = 0, n_cross = 0, n_text_attn = 0;
    unsigned char *dual = calloc((size_t)(m->table.n > 0 ? m->table.n : 1), 1);
    if (!dual) {
        snprintf(e->why, sizeof e->why, "out of memory");
        return;
    }
    dual_stream_blocks(&m->table, dual);
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, loc);
        weights += (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0) * b;
        if (w->ndim != 2)
            continue;
        const rows_class rc = rows_of(w);
        const int q = is_query_proj(w->name);
        n_attn += q && rc == ROWS_ALL;
        n_text_attn += q && rc == ROWS_TEXT;
        n_cross += ends_with(w->name, "attn2.to_q.weight");
        if (rc == ROWS_ONE)
            continue; /* AdaLN and the conditioning embedders: one row per sample, ~no FLOPs */
        /* in a joint model's dual-stream block the other linears run on the image rows */
        const double rows = rc == ROWS_TEXT ? txt : dual[i] && !cross ? s - txt : s;
        const double p = (double)w->shape[0] * (double)w->shape[1];
        const int sharded = w->style != MDT_TP_REPLICATED;
        e->flops_linear += 2.0 * rows * (sharded ? p / T : p);
        elementwise += rows * (double)loc[0];
        if (T > 1 && (w->style == MDT_TP_ROWWISE || w->style == MDT_TP_PACKED_ROWWISE)) {
            n_rowwise += 1; /* one all-reduce of its output rows (reduce-scatter + all-gather) */
            rows_ar += rows * (double)w->shape[0];
        }
    }
    free(dual);
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
    e->act_bytes = mdt_act_bytes(m, T, R, U, 1, S, b);
    /* placement: tp innermost on a node, then ulysses, then ring (only what exceeds a node
     * crosses it) */
    const int node = dev->node_size;
    const int x_tp = T > node, x_u = T * U > node, x_r = T * U * R > node;
    const double f_attn = dev->flops_attn > 0 ? dev->flops_attn : dev->flops;
    const double t_attn = e->flops_attn / f_attn;
    e->t_compute = e->flops_linear / dev->flops + t_attn +
                   (dev->flops_other > 0 ? e->flops_other / dev->flops_other : 0);
    const double t_ring =
        coll_s(dev, MDT_COST_SENDRECV, x_r, R > 1 ? n_attn * (R - 1.0) : 0, e->bytes_ring);
    /* the ring's next block travels while this one is attended, as far as the transport moves
     * data while no MPI call runs (measured: overlap; a preset assumes all of it) */
    const mdt_link_cost *rc = &dev->coll[x_r ? MDT_LINK_INTER : MDT_LINK_INTRA][MDT_COST_SENDRECV];
    const double hide = rc->bw > 0 ? rc->overlap : 1.0;
    e->t_comm = coll_s(dev, MDT_COST_ALLREDUCE, x_tp, n_rowwise, e->bytes_tp) +
                coll_s(dev, MDT_COST_ALLTOALL, x_u, U > 1 ? n_attn * 4.0 : 0, e->bytes_ulysses) +
                t_ring - hide * fmin(t_ring, t_attn) +
                coll_s(dev, MDT_COST_ALLGATHER, x_r || x_u, P > 1 ? 1 : 0, e->bytes_cp);
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
