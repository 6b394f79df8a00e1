/*
 * joint.h — the MMDiT joint-stream pieces of the DiT toolkit: families whose double blocks keep
 * an image stream and a text stream and attend over the joint sequence [text | image] (Flux,
 * Flux.2, Qwen-Image). Read the two streams, build RoPE tables from per-token ids, run the
 * modulated joint attention and the GELU feed-forward half of a block, and end the forward on
 * the image rows. Everything goes through dit.h, so each piece has its TP and CP form there.
 *
 * Modulations: a stream's AdaLayerNormZero output mod [B, 6C] holds (shift, scale, gate) of the
 * attention half, then of the feed-forward half; the final AdaLayerNormContinuous one [B, 2C]
 * holds (scale, shift), scale first.
 */
#ifndef MDT_MODELS_JOINT_H
#define MDT_MODELS_JOINT_H

#include "models/dit.h"

/* attn.add_q_proj ... attn.to_add_out, attn.norm_added_q/k: the text stream's projections. */
extern const mdt_attn_names mdt_attn_added;
/* diffusers' Flux _cp_plan: hidden_states, encoder_hidden_states, img_ids and txt_ids split on
 * their token axis into P chunks each; sample gathered on its token axis. */
extern const mdt_cp_plan mdt_joint_cp_plan;

/* A double block's attention: the image stream's q/k/v and to_out, the text stream's. */
typedef struct mdt_joint_attn {
    mdt_qkv img, ctx;
    mdt_lin to_out, to_add_out;
} mdt_joint_attn;

/* The two streams a forward reads: hidden_states [B, Si, in] and encoder_hidden_states [B, St,
 * joint], whole (Si, St) and this rank's chunk (si, st). */
typedef struct mdt_joint_in {
    int64_t B, Si, St, si, st;
    const float *hs, *ehs; /* host [B, si, in], [B, st, joint] */
} mdt_joint_in;

/* One double block's streams and scratch: x [B, si, C] image, c [B, st, C] text, and from the
 * arena nx [B, si, C], nc [B, st, C], tmp [B max(si, st), C], ao [B, si + st, C/T]. */
typedef struct mdt_joint_rows {
    float *x, *c;
    int64_t si, st;
    float *nx, *nc, *tmp, *ao;
} mdt_joint_rows;

/* ---- weights ---- */
/* The image stream's attention (attn.to_q/k/v, to_out.0) then the text stream's (add_*_proj,
 * to_add_out): q/k/v colwise, outputs rowwise, inner = C. */
mdt_status mdt_joint_declare_attention(mdt_wtable *t, const char *pfx, mdt_joint_attn *w, int64_t C,
                                       int bias);
/* Both streams' per-head q/k RMSNorm weights [D]. */
mdt_status mdt_joint_declare_qk_norms(mdt_wtable *t, const char *pfx, mdt_joint_attn *w, int64_t D,
                                      float eps);

/* The output head: norm_out.linear [2C, C] (AdaLayerNormContinuous, replicated-input rowwise)
 * and proj_out [O, C] (replicated). */
mdt_status mdt_joint_declare_out(mdt_wtable *t, mdt_lin *norm_out, mdt_lin *proj_out, int64_t C,
                                 int64_t O, int bias);

/* ---- inputs ---- */
/* Reads and checks the two streams (one-line errors naming the tensor); with `split`, cut to
 * this rank's chunks by the CP plan, else si = Si and st = St. Sets d->B. */
mdt_status mdt_joint_read_streams(mdt_dit *d, const mdt_tensor_set *in, int64_t in_ch,
                                  int64_t joint, int split, mdt_joint_in *x);
/* ids `name` [S, A] or [B, S, A] (batch 0 is used, like diffusers), any number type, cut to this
 * rank's chunk: *ids [s, A] host, *A its width. A = naxes when `exact` (Flux's FluxPosEmbed takes
 * one axis per column), else A >= naxes and the first naxes columns are used (Flux2PosEmbed). */
mdt_status mdt_joint_read_ids(mdt_dit *d, const mdt_tensor_set *in, const char *name, int64_t S,
                              int naxes, int exact, const float **ids, int64_t *A);
/* RoPE tables of this rank's joint sequence [text rows | image rows] (st + si rows, D = the sum
 * of axes): the first naxes columns of txt_ids [st, At] and img_ids [si, Ai]; per axis of width
 * a, pair j turns at 1/theta^(2j/a) times its id, angles in float64 then float32; interleaved
 * pairs. Tables in backend memory. */
mdt_status mdt_joint_rope(const mdt_dit *d, const float *txt_ids, int64_t At, const float *img_ids,
                          int64_t Ai, int64_t st, int64_t si, int naxes, const int64_t *axes,
                          double theta, mdt_rope *rope);

/* ---- blocks ---- */
/* Scratch of one double block (see mdt_joint_rows) from the arena; MDT_E_NOMEM on failure. */
mdt_status mdt_joint_rows_alloc(const mdt_dit *d, int64_t C, int64_t Cl, mdt_joint_rows *r);
/* The attention half of a double block: both streams LayerNorm'd (eps) and modulated by the
 * first (shift, scale) of mi (image) and mt (text) [B, 6C], projected to this rank's heads (text
 * rows first), attended over the joint sequence under the layout's CP, and added back through
 * to_out / to_add_out with the first gates. Leaves nothing needed in the scratch. */
mdt_status mdt_joint_attention(const mdt_dit *d, const mdt_joint_attn *w, const float *mi,
                               const float *mt, float eps, const mdt_rope *rope, const mdt_heads *h,
                               const mdt_joint_rows *r);
/* x [B, n, C] += gate * net.2(GELU_tanh(net.0(LN(x) (1 + scale) + shift))): the feed-forward
 * half with the second (shift, scale, gate) of mod [B, 6C]; nbuf [B n, C], hbuf [B n, M/T],
 * ybuf [B n, C] scratch. */
mdt_status mdt_joint_ff_gelu(const mdt_dit *d, float *x, int64_t n, const float *mod, float eps,
                             const mdt_lin *l0, const mdt_lin *l2, float *nbuf, float *hbuf,
                             float *ybuf);
/* After block i of the stack `name`: the arena back to mk (a block's scratch is reused by the
 * next), then the NaN guard named "name.i" over x [B, nx, C] and, for a double block, c [B, nc,
 * C] (NULL for a single block); after the first double block, the test seam "step". */
mdt_status mdt_joint_block_done(const mdt_dit *d, mdt_arena_mark mk, const char *name, int64_t i,
                                int64_t C, const float *x, int64_t nx, const float *c, int64_t nc);
/* A family's double block i on image x [B, si, C] and text c [B, st, C], and single block i on
 * the joint rows h [B, st + si, C]; ctx is the family's own (weights, inputs, heads). */
typedef mdt_status (*mdt_joint_double_fn)(const void *ctx, const mdt_dit *d, int64_t i, float *x,
                                          float *c);
typedef mdt_status (*mdt_joint_single_fn)(const void *ctx, const mdt_dit *d, int64_t i, float *h);
/* The block stacks of a Flux-like forward: double blocks 0..nd-1 ("transformer_blocks") on xs
 * [B, si, C] and c [B, st, C], then *h [B, st + si, C] (from the arena) = per batch element the
 * text rows then the image rows, through single blocks 0..ns-1 ("single_transformer_blocks");
 * each block followed by mdt_joint_block_done. */
mdt_status mdt_joint_blocks(const mdt_dit *d, const mdt_joint_in *x, int64_t C, float *xs, float *c,
                            int64_t nd, mdt_joint_double_fn dbl, int64_t ns,
                            mdt_joint_single_fn sgl, const void *ctx, float **h);

/* ---- the end of a forward ---- */
/* norm_out on the image rows of h [B, st + si, C] (LayerNorm eps, then mo [B, 2C] = (scale,
 * shift)) into xn [B, si, C], proj_out, the NaN guard; `sample` [B, Si, O] gathered by the CP
 * plan; then the promise of `calls` CP attention calls over [St | Si] and mdt_dit_end. */
mdt_status mdt_joint_finish(mdt_dit *d, const mdt_tensor_set *in, const mdt_joint_in *x,
                            const float *h, const float *mo, float eps, const mdt_lin *proj_out,
                            float *xn, int64_t calls, mdt_tensor_set *out);

#endif /* MDT_MODELS_JOINT_H */
