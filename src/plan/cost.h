/*
 * cost.h — the layout planner's scaling model: for a model (its weight table and config), a
 * sequence length and a device preset, the per-rank memory, FLOPs and bytes per axis of one
 * forward under T x R x U, and a predicted step time. Formulas: reference/peers.md §8 applied
 * to meshdit's schedule (docs/perf.md, issue 4 table, where they match the measured counters).
 *
 * What it is not: a simulator. Rates are peak x an efficiency; collective time is bytes sent
 * per rank / the axis' bus bandwidth plus a per-call latency; the ring transfer overlaps the
 * attention it feeds. Presets are assumptions, stated in docs/perf.md.
 */
#ifndef MDT_PLAN_COST_H
#define MDT_PLAN_COST_H

#include "models/model.h"

/* A device preset (meshdit.h: mdt_device_spec): sustained FLOP/s (peak x efficiency), bus
 * bandwidth inside a node (TP, Ulysses) and between nodes (axes that span nodes), latency per
 * collective call, memory and devices per node. */
typedef mdt_device_spec mdt_device;

/* The preset `name` (devices.c): "cpu" (an older development machine, measured), "h100",
 * "h200", "trn2" (one NeuronCore); NULL for another name. */
const mdt_device *mdt_device_preset(const char *name);

/* Seconds of `calls` collectives of `kind` sending `bytes` per rank over the inter-node link or
 * not: the measured cost where the spec has it, else the flat bandwidth and latency. */
double mdt_plan_coll_seconds(const mdt_device *dev, mdt_coll_cost_kind kind, int inter,
                             double calls, double bytes);

/* One forward, batch 1, S tokens (L of them the text stream's, or a cross-attention model's
 * encoder rows), elem_bytes per activation and weight element, under e->tp x e->ring x
 * e->ulysses (set by the caller): the rest of *e (meshdit.h: mdt_layout_estimate). */
void mdt_estimate_layout(const mdt_model *m, int64_t S, int64_t L, double elem_bytes,
                         const mdt_device *dev, mdt_layout_estimate *e);

#endif /* MDT_PLAN_COST_H */
