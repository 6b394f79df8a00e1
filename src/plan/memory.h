/*
 * memory.h — what one rank of a run holds at its peak (its weights and one forward's
 * activations), and the checks that refuse a layout or a forward that would not fit before any
 * weight is read or any step runs (meshdit.h: mdt_check_memory; the server's per-request check).
 */
#ifndef MDT_PLAN_MEMORY_H
#define MDT_PLAN_MEMORY_H

#include "models/model.h"

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
    int64_t input_bytes; /* every input tensor, and the copy a forward converts one in another
                            dtype than f32 to (f32, or int64 for integers) */
    int64_t split_f32;   /* the f32 bytes of the inputs the CP plan cuts: each CP rank copies its
                            1 / (R U) chunk of them */
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

/* This rank's weights plus the activations of a forward of `inputs` against `limit` bytes
 * (MDT_E_NOMEM naming the need and the limit; MDT_OK when limit <= 0). Local: the caller agrees
 * on the verdict. */
mdt_status mdt_check_forward_memory(const mdt_model *m, const mdt_tensor_set *inputs, int64_t limit,
                                    int device_activations);

#endif /* MDT_PLAN_MEMORY_H */
