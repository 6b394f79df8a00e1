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
    struct mdt_cache *ts; /* TaylorSeer (models/cache.h): the outputs' factors, or NULL */
    int64_t slot;         /* its slots: the image output's, the text one's is slot + 1 */
    /* Qwen-Image-Edit-2511's zero_cond_t: image rows from `split` on (this rank's rows of the
     * condition images) are modulated by mi0 [B, 6C] (the table of timestep 0) instead of mi;
     * mi0 NULL: every image row by mi */
    const float *mi0;
    int64_t split;
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
/* Per-token position ids of one stream: rows of `width` ids (host memory). */
typedef struct mdt_ids {
    const float *v; /* [rows, width] */
    int64_t rows, width;
} mdt_ids;
/* The rotary axes of config.json's axes_dims_rope: n axes of widths dims[] (summing to the head
 * width), turning at powers of theta. */
typedef struct mdt_rope_axes {
    int n;
    const int64_t *dims;
    double theta;
} mdt_rope_axes;

/* ids `name` [S, A] or [B, S, A] (batch 0 is used, like diffusers), any number type, cut to this
 * rank's chunk: *ids [s, A] host. A = naxes when `exact` (Flux's FluxPosEmbed takes one axis per
 * column), else A >= naxes and the first naxes columns are used (Flux2PosEmbed). */
mdt_status mdt_joint_read_ids(mdt_dit *d, const mdt_tensor_set *in, const char *name, int64_t S,
                              int naxes, int exact, mdt_ids *ids);
/* RoPE tables of this rank's joint sequence [text rows | image rows] (txt->rows + img->rows
 * rows, D = the sum of the axes): the first axes->n columns of the text and image ids; per axis
 * of width a, pair j turns at 1/theta^(2j/a) times its id, angles in float64 then float32;
 * interleaved pairs. Tables in backend memory. */
mdt_status mdt_joint_rope(const mdt_dit *d, const mdt_ids *txt, const mdt_ids *img,
                          const mdt_rope_axes *axes, mdt_rope *rope);

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
/* The feed-forward half of a double block on one stream, in place, and its scratch. */
typedef struct mdt_joint_ff {
    float *x;                  /* the stream [B, n, C] */
    int64_t n;                 /* its rows per batch element */
    const float *mod;          /* its modulation [B, 6C]: the second (shift, scale, gate) */
    float eps;                 /* the LayerNorm's */
    float *nbuf, *hbuf, *ybuf; /* scratch [B n, C], [B n, M/T], [B n, C] */
    const float *mod0;         /* rows from `split` on modulated by mod0 (mdt_joint_rows.mi0) */
    int64_t split;
} mdt_joint_ff;
/* x += gate * net.2(GELU_tanh(net.0(LN(x) (1 + scale) + shift))), net.0 = l0, net.2 = l2. */
mdt_status mdt_joint_ff_gelu(const mdt_dit *d, const mdt_lin *l0, const mdt_lin *l2,
                             const mdt_joint_ff *f);
/* h [B, st + si, C] (from the arena) = per batch element the text rows c [B, st, C] then the image
 * rows x [B, si, C]: the joint rows the single blocks run on after the double blocks. */
mdt_status mdt_joint_concat(const mdt_dit *d, const mdt_joint_in *s, int64_t C, const float *c,
                            const float *x, float **h);

/* ---- the end of a forward ---- */
/* What ends a joint forward: the last hidden rows, the output head and the attention it ran. */
typedef struct mdt_joint_out {
    const float *h;          /* [B, st + si, C] the joint rows after the last block */
    const float *mo;         /* [B, 2C] norm_out's (scale, shift) */
    float eps;               /* norm_out's LayerNorm */
    const mdt_lin *proj_out; /* [O, C] */
    float *xn;               /* scratch [B, si, C] */
    int64_t calls;           /* CP attention calls of the forward (blocks x batch) */
} mdt_joint_out;
/* norm_out on the image rows of o->h (LayerNorm, then (scale, shift)) into o->xn, proj_out, the
 * NaN guard; `sample` [B, Si, O] gathered by the CP plan; then the promise of o->calls CP
 * attention calls over [St | Si] and mdt_dit_end. */
mdt_status mdt_joint_finish(mdt_dit *d, const mdt_tensor_set *in, const mdt_joint_in *x,
                            const mdt_joint_out *o, mdt_tensor_set *out);

#endif /* MDT_MODELS_JOINT_H */
