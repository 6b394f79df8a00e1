/*
 * dit.h — the DiT toolkit: the pieces every diffusion-transformer family is built from, each
 * with its tensor-parallel form, so a family's forward reads like the diffusers module it
 * mirrors. A forward starts a context (mdt_dit_begin: mesh, TP coordinate, arenas, the CP
 * executor of cp.h), then projects, modulates and attends through it, and ends with the
 * no-silent-degrade promise built from its attention calls (mdt_dit_promise_*).
 *
 * Layouts: activations are token-major [B, S_local, width]; attention operands head-major
 * [B, H/T, S_local, D]. Colwise linears produce this rank's output features (l->out_local),
 * rowwise ones reduce over the TP group and add the full bias once.
 */
#ifndef MDT_MODELS_DIT_H
#define MDT_MODELS_DIT_H

#include "backend/backend.h"
#include "models/cp.h"
#include "models/inputs.h"
#include "models/model.h"

typedef struct mdt_dit {
    mdt_model *m;
    mdt_mesh *mesh;     /* NULL = one rank */
    int T, k;           /* TP degree and this rank's shard index */
    mdt_cp cp;          /* the CP plan's executor */
    mdt_arena *ar, *ha; /* activations (backend memory); host staging */
    int64_t B;          /* batch */
    const float *cond;  /* [cond_rows, cond_width] SiLU(temb), replicated: the AdaLN input */
    int64_t cond_rows, cond_width;
    int64_t heads, head_dim; /* this rank's heads (H/T) and D */
} mdt_dit;

typedef struct mdt_rope {
    const float *cos_t, *sin_t; /* [S_local, rot] */
    int64_t rot;                /* rotated channels per head (the table width) */
    mdt_rope_kind kind;
} mdt_rope;
typedef struct mdt_qkv {
    mdt_lin q, k, v;              /* colwise: this rank's heads */
    const float *norm_q, *norm_k; /* per-head RMSNorm weights [D] */
    float eps;
} mdt_qkv;
typedef struct mdt_heads {
    float *q, *k, *v; /* [B, H/T, S, D] head-major */
    int64_t S;        /* rows per batch element */
} mdt_heads;
/* Starts a forward of `m` with `heads` attention heads of `head_dim` in all. */
void mdt_dit_begin(mdt_dit *d, mdt_model *m, int64_t heads, int64_t head_dim);

/* ---- weights of the common diffusers modules (appended to a family's table in order) ---- */
/* Tensor names of an Attention module under a block prefix: the projections and the per-head
 * norms (".weight" is appended). */
typedef struct mdt_attn_names {
    const char *q, *k, *v, *out, *norm_q, *norm_k;
    /* the rows k and v run on when they are not the module's own (cross-attention: the
     * context's, MDT_ROWS_TEXT); MDT_ROWS_UNSET: the table's rows, as q */
    mdt_rows kv_rows;
} mdt_attn_names;
extern const mdt_attn_names mdt_attn_self; /* attn.to_q ... attn.to_out.0, attn.norm_q/k */
/* q, k, v colwise [inner, C], then (out not NULL) out rowwise [C, inner]; biases if `bias`. */
mdt_status mdt_dit_declare_attention(mdt_wtable *t, const char *pfx, const mdt_attn_names *n,
                                     mdt_qkv *w, mdt_lin *out, int64_t inner, int64_t C, int bias);
/* An AdaLN projection `pfx name` [out, in] of the replicated conditioning (replicated-input
 * rowwise, one row per sample). */
mdt_status mdt_dit_declare_adaln(mdt_wtable *t, mdt_lin *l, const char *pfx, const char *name,
                                 int64_t out, int64_t in, int bias);
/* A text embedder `name` [out, in] of the text every TP rank holds whole (replicated-input
 * rowwise on the text rows, its input features split unevenly where tp does not divide them);
 * the forward runs it with mdt_dit_slice_linear. */
mdt_status mdt_dit_declare_text_embedder(mdt_wtable *t, mdt_lin *l, const char *name, int64_t out,
                                         int64_t in, int bias);
/* The per-head RMSNorm weights [D] of q and k (eps for both). */
mdt_status mdt_dit_declare_qk_norms(mdt_wtable *t, const char *pfx, const mdt_attn_names *n,
                                    mdt_qkv *w, int64_t D, float eps);
/* A FeedForward `pfx ff`: net.0.proj colwise [hidden, C] (gated: packed colwise [value | gate]
 * [2 hidden, C], each half sharded on its own) and net.2 rowwise [C, hidden]; the hidden
 * features split unevenly when tp does not divide them (plan.h: uneven; each rank's FFN then
 * runs on its l0->out_local = l2->in_local features). */
mdt_status mdt_dit_declare_ff(mdt_wtable *t, const char *pfx, const char *ff, mdt_lin *l0,
                              mdt_lin *l2, int64_t C, int64_t hidden, int gated, int bias);
/* MDT_E_INVALID unless tp divides the attention heads. */
mdt_status mdt_dit_check_heads(int64_t heads, int T);
/* MDT_E_INVALID unless tp divides n, a width sharded over TP: "tp=T does not divide WHAT n (WHY)".
 */
mdt_status mdt_dit_check_tp(int T, int64_t n, const char *what, const char *why);
/* config.json's axes_dims_rope ax[nax]: MDT_E_INVALID unless each is even and positive and they
 * sum to the head dimension. */
mdt_status mdt_dit_check_rope_axes(const int64_t *ax, int nax, int64_t head_dim);

/* ---- linears ---- */
/* y [M, l->out_local] (rows ldy apart) = x [M, l->in] . W_local^T + b_local: replicated and
 * colwise linears (packed colwise: this rank's piece of each block, side by side). */
void mdt_dit_linear(const mdt_lin *l, const float *x, int64_t M, float *y, int64_t ldy);
/* Rowwise (plain, packed or replicated-input): y [M, out] = the sum over the TP group of
 * x_local [M, l->in_local] (rows ldx apart) . W_local^T, the full bias once: added by TP rank
 * 0's GEMM before the all-reduce (no pass of its own). */
mdt_status mdt_dit_row_linear(const mdt_dit *d, const mdt_lin *l, const float *x, int64_t ldx,
                              float *y, int64_t M);
/* A replicated-input rowwise linear (an embedder of the replicated text, x [M, l->in] with rows
 * ldx apart): this rank multiplies its slice of the input features (mdt_split_range: uneven where
 * tp does not divide them) by its weight columns, y [M, out] after the all-reduce; so no TP rank
 * repeats the whole product. At tp=1 the plain linear, bias fused, as before. */
mdt_status mdt_dit_slice_linear(const mdt_dit *d, const mdt_lin *l, const float *x, int64_t ldx,
                                float *y, int64_t M);
/* AdaLN projection of the replicated conditioning: this rank multiplies its slice of input
 * features of d->cond by its weight columns; y [cond_rows, out] after the all-reduce. Under CP
 * (P > 1) each CP rank computes only its slice of the output features (mdt_split_range) and an
 * all-gather over the CP group assembles y: the weights are read once per group, not per rank. */
mdt_status mdt_dit_adaln(const mdt_dit *d, const mdt_lin *l, float *y);
/* y [M, l2->out] = l2(SiLU(l1(x [M, l1->in]))) with scratch h [M, l1->out] (replicated). */
void mdt_dit_mlp2(const mdt_lin *l1, const mdt_lin *l2, const float *x, int64_t M, float *h,
                  float *y);

/* ---- embeddings (host) ---- */
/* e [n, dim] = [cos(t f), sin(t f)], f_i = exp(-ln(1e4) i / (dim/2)) in float32 math like torch's
 * get_timestep_embedding with flip_sin_to_cos and no shift. */
void mdt_dit_timestep_embed(const float *t, int64_t n, int64_t dim, float *e);

/* ---- attention ---- */
/* Heads of S rows per batch element from the arena (NULL members on failure). */
mdt_status mdt_dit_heads_alloc(const mdt_dit *d, int64_t S, mdt_heads *h);
/* Projects x [B, n, C] (C = w->q.in) into rows s0 .. s0 + n of h, this rank's heads: RMSNorm on
 * q and k, then RoPE from rows s0.. of the tables (rope NULL: none). tmp [B n, H/T D] scratch. */
void mdt_dit_qkv(const mdt_dit *d, const mdt_qkv *w, const float *x, int64_t n, int64_t s0,
                 const mdt_rope *rope, const mdt_heads *h, float *tmp);
/* Attention of every batch element's h->S local rows over the whole sequence (spread over the
 * CP ranks when `cp`, else local); out [B, S, ld] token-major, heads at columns [0, H/T D). */
mdt_status mdt_dit_attend(const mdt_dit *d, const mdt_heads *h, int cp, float *out, int64_t ld);

/* Attention of every batch element's Sq local query rows q [B, H/T, Sq, D] over Sk keys and
 * values k, v [B, H/T, Sk, D] that this rank holds whole (cross-attention to a context that is
 * not split under CP, e.g. the text): plain attention, no exchange; out [B, Sq, ld] token-major,
 * heads at columns [0, H/T D). Counted as local attention (promise: mdt_dit_promise_kv). */
mdt_status mdt_dit_attend_kv(const mdt_dit *d, const float *q, int64_t Sq, const float *k,
                             const float *v, int64_t Sk, float *out, int64_t ld);

/* ---- norms ---- */
/* RMSNorm over a row's whole width (diffusers' "rms_norm_across_heads", Wan's QK norm) when each
 * TP rank holds W of its `width` columns (its heads): y [M, W] = x [M, W] / sqrt(ss / width +
 * eps) * w [W] (this rank's slice of the weight), where ss, the sum of squares of the whole row,
 * is this rank's sum all-reduced over TP. T = 1: the plain rmsnorm kernel. y != x. Collective
 * over TP. */
mdt_status mdt_dit_rmsnorm_tp(const mdt_dit *d, const float *x, float *y, int64_t M, int64_t W,
                              int64_t width, const float *w, float eps);

/* ---- the block loop ---- */
/* One stream of a block's output: x [B, rows, width] (this rank's rows). */
typedef struct mdt_stream {
    float *x; /* written only by the test seam */
    int64_t rows, width;
} mdt_stream;
/* After block i of the stack `stack` ("transformer_blocks"): the arena back to mk (a block's
 * scratch is reused by the next) and the NaN guard "stack.i" over its n output streams, each TP
 * rank over its part of their rows (the TP group holds them alike). */
void mdt_dit_block_done(const mdt_dit *d, mdt_arena_mark mk, const char *stack, int64_t i,
                        const mdt_stream *out, int n);
/* The test seam (core/testhooks.h) at `phase` on this rank: a rank that fails mid-forward while
 * its peers go on into the forward's collectives. */
mdt_status mdt_dit_test_point(const mdt_dit *d, const char *phase);

/* ---- no silent degrade ---- */
/* Adds to `p` what `calls` CP attention calls over a sequence made of nparts parts (each split
 * on its own into P chunks, lengths parts[]) must do on this rank under its layout. */
void mdt_dit_promise_cp(const mdt_dit *d, mdt_promise *p, const int64_t *parts, int nparts,
                        int64_t calls);
/* Adds `calls` mdt_dit_attend_kv calls of this rank's chunk of S query rows (split into the
 * layout's CP chunks) over Sk keys held whole. */
void mdt_dit_promise_kv(const mdt_dit *d, mdt_promise *p, int64_t S, int64_t Sk, int64_t calls);
/* Adds `calls` local attention calls over S rows (every rank the same, e.g. a text refiner). */
void mdt_dit_promise_local(const mdt_dit *d, mdt_promise *p, int64_t S, int64_t calls);
/* Ends the forward: the CP plan fully executed (mdt_cp_end), then what this rank did against
 * the promise (each axis with work owes bytes: TP when T > 1, ring and ulysses when CP attention
 * ran with heads here, the CP group when this rank gave rows to a gather). */
mdt_status mdt_dit_end(const mdt_dit *d, mdt_promise *p);

#endif /* MDT_MODELS_DIT_H */
