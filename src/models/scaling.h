/*
 * scaling.h — the layout planner's scaling model: for a model (its weight table and config), a
 * sequence length and a device preset, the per-rank memory, FLOPs and bytes per axis of one
 * forward under T x R x U, and a predicted step time. Formulas: reference/peers.md §8 applied
 * to meshdit's schedule (docs/perf.md, issue 4 table, where they match the measured counters).
 *
 * What it is not: a simulator. Rates are peak x an efficiency; collective time is bytes sent
 * per rank / the axis' bus bandwidth plus a per-call latency; the ring transfer overlaps the
 * attention it feeds. Presets are assumptions, stated in docs/perf.md.
 */
#ifndef MDT_SCALING_H
#define MDT_SCALING_H

#include "models/model.h"

typedef struct mdt_device {
    const char *name;
    double flops;     /* sustained FLOP/s (peak x efficiency) */
    double bw_intra;  /* bus bandwidth inside a node, bytes/s (TP, Ulysses) */
    double bw_inter;  /* between nodes (used for axes that span nodes) */
    double latency;   /* seconds per collective call */
    double mem_bytes; /* memory per device */
    int node_size;    /* devices per node */
} mdt_device;

/* "cpu" (this development machine, measured), "h100", "h200", "trn2" (one NeuronCore). */
const mdt_device *mdt_device_preset(const char *name);

typedef struct mdt_estimate {
    int T, R, U;
    int valid;
    char why[256];                   /* why invalid */
    double weight_bytes;             /* per rank, at elem_bytes per weight */
    double act_bytes;                /* per rank, activations of one forward (estimate) */
    double flops_linear, flops_attn; /* per rank */
    double bytes_tp, bytes_ulysses, bytes_ring, bytes_cp; /* sent per rank */
    double t_compute, t_comm, t_step;                     /* seconds */
} mdt_estimate;

/* One forward, batch 1, S tokens, elem_bytes per activation and weight element. */
void mdt_estimate_layout(const mdt_model *m, int T, int R, int U, int64_t S, double elem_bytes,
                         const mdt_device *dev, mdt_estimate *e);

#endif /* MDT_SCALING_H */
