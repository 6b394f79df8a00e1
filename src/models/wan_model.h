/*
 * wan_model.h — private to the Wan family (wan.c, wan_inputs.c): the model's configuration and
 * weights, and a forward's inputs as read on one rank.
 */
#ifndef MDT_MODELS_WAN_MODEL_H
#define MDT_MODELS_WAN_MODEL_H

#include "models/dit.h"

enum { WAN_MAX_LAYERS = 96 };

typedef struct wan_block {
    mdt_qkv a1, a2;         /* attn1 / attn2 q, k, v; norm_q/norm_k: across-heads weights [A/T] */
    mdt_lin o1, o2;         /* to_out.0 of attn1 / attn2 */
    mdt_lin ak, av;         /* attn2.add_k_proj / add_v_proj (I2V) */
    const float *n_ak;      /* attn2.norm_added_k [A/T] (I2V) */
    mdt_lin ff0, ff2;       /* ffn.net.0.proj, ffn.net.2 */
    const float *n2w, *n2b; /* norm2 (cross_attn_norm) */
    const float *sst;       /* scale_shift_table [6C] */
} wan_block;

typedef struct wan {
    int64_t patch[3], heads, head_dim, in_ch, out_ch, text_dim, freq_dim, ffn, layers;
    int64_t image_dim, added_kv, rope_max, pos_len;
    int cross_norm;
    double eps;
    int64_t C, Pin, Pout, axes[3]; /* width, patch widths in and out, rotary axes (t, h, w) */
    mdt_lin patch_emb, t1, t2, tproj, x1, x2, img0, img2, proj_out;
    const float *img_n1w, *img_n1b, *img_n2w, *img_n2b, *img_pos, *sst_out;
    wan_block blk[WAN_MAX_LAYERS];
} wan;

/* A forward's inputs on this rank: read, checked, cut by the CP plan and uploaded. */
typedef struct wan_in {
    int64_t F, H, W, Fp, Hp, Wp, S; /* latent frames, height, width; post-patch grid; tokens */
    int64_t s0, n;                  /* this rank's tokens [s0, s0 + n) */
    int64_t Nt, Ni, Tn;             /* text and image tokens, distinct timesteps */
    int64_t Nci, Nct;               /* image, text attention contexts (mdt_wan_context_cut) */
    const float *x;                 /* [B, n, Pin] patches of my tokens */
    const float *ehs, *img;         /* [B, Nt, text_dim]; [B, Ni, image_dim] or NULL */
    const float *e;                 /* [Tn, freq] sinusoids of the distinct timesteps */
    const int64_t *trow;            /* [B n] modulation row (distinct timestep) of my tokens */
    mdt_rope rope;                  /* [n, D] */
} wan_in;

/* Reads, checks and cuts a forward's inputs (hidden_states [B, Cin, F, H, W] patchified, the
 * timesteps (per sample [B] or per token [B, S]) as distinct values, the text, the optional image
 * embeddings, the rotary tables of this rank's tokens) and uploads them; sets d->B. */
mdt_status mdt_wan_read(const wan *f, mdt_dit *d, const mdt_tensor_set *in, wan_in *x);
/* Where diffusers' WanAttnProcessor cuts the I2V context [image (Ni) | text (Nt)] of L = Ni + Nt
 * tokens: the image attention takes the tokens before the cut, the text attention the rest. The
 * cut is L - 512 (the text encoder's padded length, hard-coded there) taken as a Python slice
 * bound: L - 512 when L >= 512, else 2 L - 512 clamped at 0. Equal to Ni exactly when Nt is 512;
 * 0 (no image tokens: diffusers attends over zero keys, giving zeros) when L <= 256 or L = 512. */
int64_t mdt_wan_context_cut(int64_t Ni, int64_t Nt);
/* proj_out rows y [B, S, Pout] (feature order (t, h, w, c)) as the video [B, Cout, F' pt, H' ph,
 * W' pw], diffusers' reshape and permute. */
void mdt_wan_unpatchify(const wan *f, const wan_in *x, int64_t B, const float *y, float *v);

#endif /* MDT_MODELS_WAN_MODEL_H */
