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

/* A device preset (meshdit.h: mdt_device_spec): sustained FLOP/s (peak x efficiency), bus
 * bandwidth inside a node (TP, Ulysses) and between nodes (axes that span nodes), latency per
 * collective call, memory and devices per node. */
typedef mdt_device_spec mdt_device;

/* "cpu" (this development machine, measured), "h100", "h200", "trn2" (one NeuronCore). */

/* The model's heads, head width, hidden and MLP widths as its family configured them. */
mdt_model_dims mdt_model_dims_of(const mdt_model *m);
/* 1: the model's text reaches it through cross-attention (Wan), its own rows beside the
 * sequence; 0: the text rows are part of the joint sequence (Flux, Qwen-Image, ...). */
int mdt_model_cross_attention(const mdt_model *m);
const mdt_device *mdt_device_preset(const char *name);

typedef struct mdt_estimate {
    int T, R, U;
    int valid;
    char why[256];       /* why invalid */
    double weight_bytes; /* per rank, at elem_bytes per weight */
    double act_bytes;    /* per rank, activations of one forward (estimate) */
    double flops_linear, flops_attn, flops_other;         /* per rank */
    double bytes_tp, bytes_ulysses, bytes_ring, bytes_cp; /* sent per rank */
    double t_compute, t_comm, t_step;                     /* seconds */
} mdt_estimate;

/* One forward, batch 1, S tokens (L of them the text stream's, or a cross-attention model's
 * encoder rows), elem_bytes per activation and weight element. */
void mdt_estimate_layout(const mdt_model *m, int T, int R, int U, int64_t S, int64_t L,
                         double elem_bytes, const mdt_device *dev, mdt_estimate *e);

/* ---- memory of one rank of `meshdit run`, checked before any weight is read ---- */

/* Activation bytes of one forward on one rank under T x R x U for `batch` sequences of S token
 * rows (all streams together: image + text (+ audio)), elem_bytes per element (4: meshdit keeps
 * activations in f32). Per local row (ceil(S / (R x U)) of them, per sequence): 10 D + (4 A +
 * 1.5 F)/T elements, plus 14 A/T under Ulysses (the gathered heads, sent and received) and 14 A/T
 * under Ring (K/V blocks in flight, the merge), D = hidden size, A = heads x head dim, F = the MLP
 * width (`ffn_dim`, else 4 A as in Flux). The coefficients fit this implementation's measured
 * peaks (first forward, arena chunk slack included) on Flux and MiniMax-H3 configs with D = A =
 * 1024 at tp 1 and 2, ring 2, ulysses 2: the estimate lies within -8% .. +16% of them. */
double mdt_act_bytes(const mdt_model *m, int T, int R, int U, int64_t batch, int64_t S,
                     double elem_bytes);

/* What `meshdit run` holds on one rank at its peak. */
typedef struct mdt_run_memory {
    int64_t weights;     /* resident weights: 4 bytes each, 2 per linear weight under bf16 */
    int64_t activations; /* mdt_act_bytes (f32) + the inputs (whole on every rank) + 3 copies of
                            the output + the arenas' first chunks (2 MiB) + under bf16 the
                            widening panel (at most 64 MiB); 0 when they live on a GPU */
} mdt_run_memory;

/* The inputs of a run as the estimate sees them. */
typedef struct mdt_run_inputs {
    int64_t batch, rows; /* sequences and token rows per sequence (all streams) */
    int64_t input_bytes; /* every input tensor */
    int64_t latent_f32;  /* bytes of the latent input in f32 (the output has its shape) */
    int bf16;            /* linear weights held in bf16 */
    int device_acts;     /* activations live on a GPU: not counted */
} mdt_run_inputs;

/* The per-rank memory of `meshdit run` at T x R x U (a layout the model takes). */
mdt_run_memory mdt_run_memory_at(const mdt_model *m, int T, int R, int U, const mdt_run_inputs *in);

/* Refuses (MDT_E_NOMEM) a layout whose per-rank memory exceeds `limit` bytes, before any weight
 * is read. The message names the need (weights + activations), `limit_what` (e.g. "the
 * --max-memory limit of 8.0 GiB") and the smallest TP degree above T that would fit. */
mdt_status mdt_check_run_memory(const mdt_model *m, int T, int R, int U, const mdt_run_inputs *in,
                                int64_t limit, const char *limit_what);

/* `b` bytes in binary units with one decimal ("2.4 MiB", "267.5 KiB") into buf; returns buf. */
const char *mdt_fmt_size(int64_t b, char *buf, size_t cap);

/* Bytes this process may still allocate before the kernel's out-of-memory killer acts, or -1
 * when nothing can be read: the smallest of MemAvailable (/proc/meminfo) and, for every cgroup
 * of this process with a memory limit (v2: memory.max of its cgroup and each parent; v1:
 * memory.limit_in_bytes and hierarchical_memory_limit), the limit minus the usage plus the
 * cgroup's file cache (active + inactive file pages, which the kernel reclaims first). `root`
 * prefixes every path ("" for this system; a directory tree in tests). `what` receives the
 * source of the smallest ("MemAvailable", "cgroup memory.max", ...). */
int64_t mdt_mem_available(const char *root, char *what, size_t cap);

#endif /* MDT_SCALING_H */
