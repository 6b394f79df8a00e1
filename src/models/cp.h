/*
 * cp.h — the context-parallel executor: runs a family's declared CP plan (plan.h), so the plan
 * `inspect` prints is the plan that executes. On entry a forward takes each split input through
 * mdt_cp_take, which cuts this rank's chunk along the plan's dim; on exit it gives each gathered
 * output through mdt_cp_give, which all-gathers the chunks in chunk order (and, for a `by`
 * gather, picks the output rows from the gathered packed sequence). mdt_cp_end refuses a forward
 * that skipped a declared split or gather. The sequence is split into P = ring x ulysses chunks
 * (mdt_split_range: the first S mod P chunks one row longer); chunk = the rank's CP index.
 */
#ifndef MDT_MODELS_CP_H
#define MDT_MODELS_CP_H

#include "comm/mesh.h"
#include "parallel/plan.h"

typedef struct mdt_cp {
    const mdt_cp_plan *plan;
    mdt_mesh *mesh;     /* the mesh when the sequence is split (P > 1), else NULL */
    int P, chunk;       /* chunks and this rank's chunk */
    unsigned taken;     /* bit i: plan->split[i] taken */
    unsigned given;     /* bit i: plan->gather[i] given */
    int64_t given_rows; /* rows this rank contributed to the gathers */
} mdt_cp;

/* Starts a forward's executor for `plan` on `mesh` (NULL: one rank, P = 1). The test seam's
 * skip_cp_split reproduces the upstream bug of every rank computing the whole sequence (P = 1)
 * so that the no-silent-degrade check can be shown to catch it. */
void mdt_cp_begin(mdt_cp *cp, const mdt_cp_plan *plan, mdt_mesh *mesh);

/* This rank's chunk of split input `name`: x (elements of `esize` bytes, shape [ndim], already
 * checked by the caller) cut along the plan's dim to rows [*start, *start + *len), copied into
 * `a` (x itself when P = 1). MDT_E_INVALID if the plan does not split `name` (a forward cannot
 * split what the plan does not declare). */
mdt_status mdt_cp_take(mdt_cp *cp, const char *name, const void *x, size_t esize, int ndim,
                       const int64_t *shape, mdt_arena *a, const void **local, int64_t *start,
                       int64_t *len);

/* Counts optional split input `name` as taken: the forward was not given it, so there is
 * nothing to split. */
void mdt_cp_absent(mdt_cp *cp, const char *name);

/* Gathers output `name` into the host tensor `out` [B, rows, O] the caller added: every chunk c
 * holds loc [B, n_c, O] (rows c of S, in the backend's memory); full [B, S, O] is built in `ar`
 * in chunk order; a plain gather copies it (rows = S), a `by` gather copies its rows idx[0:rows]
 * where idx is the plan's `by` input, read from `in` here (length rows, each in [0, S)).
 * Collective over the CP group. */
mdt_status mdt_cp_give(mdt_cp *cp, const char *name, mdt_arena *ar, mdt_arena *ha,
                       const mdt_tensor_set *in, int64_t S, const float *loc, mdt_tensor *out);

/* MDT_OK when every split input was taken and every gathered output given (or P = 1);
 * MDT_E_INVALID naming the first that was not, otherwise. */
mdt_status mdt_cp_end(const mdt_cp *cp);

/* The all-gather under mdt_cp_give: chunks loc [B, n_c, O] -> full [B, S, O] on every rank;
 * P = 1 copies. Scratch from `ar`. */
mdt_status mdt_cp_gather_rows(mdt_mesh *mesh, mdt_arena *ar, int P, int64_t B, int64_t S, int64_t O,
                              const float *loc, float *full);

#endif /* MDT_MODELS_CP_H */
