/*
 * branches.h — the forwards of one sampler step when it has more than one: the two branches of
 * classifier-free guidance (the inputs' negative_NAME tensors replace NAME in the unconditional
 * one) combined by the family's formula, and the cfg axis of the mesh, whose two groups run the
 * two branches at once — or, without guidance, the two halves of the step's batch — and trade
 * their predictions once per step.
 *
 * Same bits on every layout of the groups: with cfg 1 both branches run in turn on the whole
 * mesh, with cfg 2 each on its group's tp x ring x ulysses mesh; with the same inner layout the
 * arithmetic of each forward is the same, and the combination runs on the same two predictions on
 * every rank.
 *
 * Not here: the Euler update and the step loop (sampler.c), the forward (models/forward.c).
 */
#ifndef MDT_SAMPLER_BRANCHES_H
#define MDT_SAMPLER_BRANCHES_H

#include "models/model.h"

typedef struct mdt_branches {
    int guided;             /* two branches per step: conditional (0), unconditional (1) */
    int split;              /* no guidance, cfg 2: each group takes a part of the batch */
    int C, c;               /* the cfg degree and this rank's group */
    double scale;           /* the guidance scale */
    mdt_tensor_set *set[2]; /* the inputs of branch / batch part k (copies) */
    int64_t b0[2], nb[2];   /* split: the batch rows of each part */
    int mine;               /* cfg 2: the branch or part this group computes (its own, c) */
    int64_t n;              /* cfg 1: floats of a branch's prediction */
    int64_t n_mine;         /* cfg 2: floats of this group's prediction */
    int64_t width;          /* the prediction's last dimension (a token's vector) */
    int out_ndim;           /* the whole prediction's shape (a part's with the batch's rows) */
    int64_t out_shape[MDT_MAX_DIMS];
    float *pred[2]; /* cfg 1: each branch's prediction [n] */
    float *v;       /* the step's prediction [nv], shape out_shape (after a step) */
    int64_t nv;
    float *send; /* cfg 2: [1 + n_mine] this group's tagged prediction */
    float *xchg; /* cfg 2: the exchange's receive buffer, both tagged rows */
} mdt_branches;

/* Reads what the step needs from `in` (the caller's inputs, latent and timestep F32) for a run
 * with guidance `scale` (0: none) on m's mesh: guided when `in` carries negative_NAME inputs of
 * the family's branch inputs (then scale must be > 0, and each negative tensor matches its
 * conditional one's rank, its batch where the family batches it, its width where it is
 * [B, S, C]; its sequence may be another length), split when cfg is 2 without guidance (the batch,
 * at least 2, is cut between the groups). One line naming the tensor, option or constraint
 * otherwise; a cfg group never idles. Local (every rank reads the same inputs). */
mdt_status mdt_branches_init(mdt_branches *br, const mdt_model *m, const mdt_tensor_set *in,
                             double scale, int steps);
/* 1 when the step runs through branches (guided or split), else a plain forward does. */
int mdt_branches_active(const mdt_branches *br);
/* One step's forwards on the latent and timestep of `in` (copied into the branch inputs first):
 * br->v [br->nv] (shape br->out_shape) receives the prediction the sampler integrates — the
 * branches combined, or the gathered batch parts; the same bits on every rank. Collective over
 * the model's mesh; `step` (0-based) tags the exchange, which is checked: each group's
 * prediction must come from its own branch or part (no silent degrade). */
mdt_status mdt_branches_step(mdt_branches *br, mdt_model *m, const mdt_tensor_set *in, int step);
void mdt_branches_free(mdt_branches *br);
/* v [n] = the guided prediction of v_c and v_u [n] by `rule` over rows (tokens) of `width`:
 * v_u + scale (v_c - v_u), rescaled per token to v_c's norm for MDT_CFG_RESCALED. MDT_E_NUMERIC
 * naming the guided combination when a rescaled token goes non-finite (a combined norm of 0 or
 * past f32), v then unfit for use. Local. */
mdt_status mdt_branches_combine(mdt_cfg_rule rule, double scale, const float *vc, const float *vu,
                                int64_t n, int64_t width, float *v);

#endif /* MDT_SAMPLER_BRANCHES_H */
