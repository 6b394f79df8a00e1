/* scaling.c — see scaling.h. */
#include "scaling.h"

#include <math.h>
#include <string.h>

static const mdt_device k_devices[] = {
    /* measured on the 2-vCPU development VM (docs/perf.md): fp32 forward 62 GFLOP/s, MPI shared
     * memory ~1 GB/s all-reduce, ~3 GB/s all-to-all */
    {"cpu", 62e9, 1.5e9, 1.5e9, 50e-6, 24e9, 2},
    /* dense bf16 989 TFLOPS x 0.62 (the H3 SGLang calibration of peers.md §8: ~610 TFLOPS);
     * NVLink busbw ~370 GB/s (NCCL, non-all-reduce); 400 Gb/s NIC ~48 GB/s between nodes */
    {"h100", 989e12 * 0.62, 370e9, 48e9, 20e-6, 80e9, 8},
    {"h200", 989e12 * 0.62, 370e9, 48e9, 20e-6, 141e9, 8},
    /* one logical Trainium2 core (LNC=2: two physical NeuronCores, 64 per trn2.48xlarge):
     * 667 TFLOPS bf16 per 8-core chip -> 167 per logical core, x 0.6; 96 GB HBM per chip -> 24
     * GB; link bandwidth per core an assumption (NeuronLink shared by the chip's cores) */
    {"trn2", 667e12 / 4 * 0.6, 100e9, 25e9, 30e-6, 24e9, 64},
};

const mdt_device *mdt_device_preset(const char *name) {
    for (size_t i = 0; i < sizeof k_devices / sizeof k_devices[0]; i++)
        if (strcmp(k_devices[i].name, name) == 0)
            return &k_devices[i];
    return NULL;
}

static int64_t cfg_or(const mdt_model *m, const char *key, int64_t def) {
    int64_t v = def;
    if (mdt_cfg_int(m->config, key, 0, def, &v) != MDT_OK)
        v = def;
    return v;
}

void mdt_estimate_layout(const mdt_model *m, int T, int R, int U, int64_t S, double b,
                         const mdt_device *dev, mdt_estimate *e) {
    memset(e, 0, sizeof *e);
    e->T = T, e->R = R, e->U = U;
    if (mdt_model_check_layout(m, T, R, U) != MDT_OK) {
        snprintf(e->why, sizeof e->why, "%s", mdt_last_error());
        mdt_error_clear();
        return;
    }
    const int64_t heads = cfg_or(m, "num_attention_heads", 1),
                  hd = cfg_or(m, "attention_head_dim", 1);
    const double A = (double)(heads * hd);
    const double D = (double)cfg_or(m, "hidden_size", heads * hd);
    double p_shard = 0, p_repl = 0, weights = 0;
    int n_attn = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, loc);
        weights += (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0) * b;
        const size_t len = strlen(w->name);
        if (len >= 16 && strcmp(w->name + len - 16, "attn.to_q.weight") == 0)
            n_attn++;
        if (w->ndim != 2 || w->style == MDT_TP_REPLICATED_INPUT_ROWWISE)
            continue; /* AdaLN projections run on timestep rows: ~no FLOPs */
        const double p = (double)w->shape[0] * (double)w->shape[1];
        if (w->style == MDT_TP_REPLICATED)
            p_repl += p;
        else
            p_shard += p;
    }
    const double P = (double)R * U, s = (double)S / P; /* local rows */
    e->weight_bytes = weights;
    e->flops_linear = 2.0 * s * (p_shard / T + p_repl);
    e->flops_attn = 4.0 * (double)S * (double)S * A * n_attn / (T * P);
    /* per attention block: 2 TP all-reduces of the local rows (reduce-scatter + all-gather);
     * Ulysses q, k, v in and out; ring K and V of the other blocks; one output gather */
    e->bytes_tp = T > 1 ? n_attn * 2.0 * 2.0 * (T - 1) / T * s * D * b : 0;
    e->bytes_ulysses = U > 1 ? n_attn * 4.0 * (U - 1) / U * s * (A / T) * b : 0;
    e->bytes_ring = R > 1 ? n_attn * 2.0 * (R - 1) * ((double)S / R) * (A / (T * U)) * b : 0;
    e->bytes_cp = P > 1 ? (P - 1) * s * D * b : 0;
    e->act_bytes =
        s * b * (10.0 * D + 4.0 * A / T) + (R > 1 ? 4.0 * ((double)S / R) * (A / (T * U)) * b : 0);
    /* placement: tp innermost on a node, then ulysses, then ring (only what exceeds a node
     * crosses it) */
    const int node = dev->node_size;
    const double bw_tp = T <= node ? dev->bw_intra : dev->bw_inter;
    const double bw_u = T * U <= node ? dev->bw_intra : dev->bw_inter;
    const double bw_r = T * U * R <= node ? dev->bw_intra : dev->bw_inter;
    const double t_attn = e->flops_attn / dev->flops;
    e->t_compute = (e->flops_linear + e->flops_attn) / dev->flops;
    const double t_ring = e->bytes_ring / bw_r + (R > 1 ? n_attn * (R - 1) * dev->latency : 0);
    e->t_comm = e->bytes_tp / bw_tp + (T > 1 ? n_attn * 2 * dev->latency : 0) +
                e->bytes_ulysses / bw_u + (U > 1 ? n_attn * 2 * dev->latency : 0) +
                fmax(0.0, t_ring - t_attn) + e->bytes_cp / bw_r;
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
