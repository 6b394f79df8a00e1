/*
 * flux.c — diffusers' FluxTransformer2DModel: config, weight table with TP styles, CP plan,
 * forward, and random inputs. Semantics follow diffusers exactly (see
 * shared/reference/parallel-semantics.md §8.1): timestep x1000, sinusoid cos-then-sin,
 * RoPE interleaved pairs from cat(txt_ids, img_ids) in float64 then float32, text first in the
 * joint sequence, AdaLayerNormZero chunk order (shift, scale, gate) x2, AdaLayerNormContinuous
 * scale-then-shift, LayerNorm eps 1e-6 without affine, per-head RMSNorm eps 1e-6, GELU(tanh).
 *
 * Not here: parallel execution (the forward runs the local shard it is given; the mesh and the
 * collectives arrive with the parallel issues), bf16 compute.
 */
#include "models/model.h"

#include "attn/attn.h"
#include "backend/backend.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { FLUX_MAX_AXES = 4 };
static const float k_eps = 1e-6f;

typedef struct flux_double {
    mdt_lin norm1, norm1_ctx;
    mdt_lin to_q, to_k, to_v, add_q, add_k, add_v, to_out, to_add_out;
    mdt_lin ff0, ff2, ffc0, ffc2;
    const float *norm_q, *norm_k, *norm_added_q, *norm_added_k;
} flux_double;

typedef struct flux_single {
    mdt_lin norm, to_q, to_k, to_v, proj_mlp, proj_out;
    const float *norm_q, *norm_k;
} flux_single;

typedef struct flux {
    int64_t patch, in_ch, out_ch, layers, single_layers, head_dim, heads, joint_dim, pooled_dim;
    int guidance;
    int naxes;
    int64_t axes[FLUX_MAX_AXES];
    int64_t inner, mlp_hidden;
    mdt_lin x_emb, ctx_emb, t_lin1, t_lin2, g_lin1, g_lin2, p_lin1, p_lin2, norm_out, proj_out;
    flux_double *dbl;
    flux_single *sgl;
    /* storage for the block arrays (the impl is a flat zeroed struct) */
    flux_double dbl_store[64];
    flux_single sgl_store[128];
} flux;

static const mdt_cp_plan k_flux_cp_plan = {
    .nsplit = 4,
    .split = {{"hidden_states", 1}, {"encoder_hidden_states", 1}, {"img_ids", 0}, {"txt_ids", 0}},
    .ngather = 1,
    .gather = {{"sample", 1}},
};

/* ---- weight table ---- */
static mdt_status add_lin(mdt_wtable *t, mdt_lin *l, const char *name, int64_t out, int64_t in,
                          mdt_tp_style style) {
    return mdt_wtable_add_linear(t, l, name, out, in, style, 1); /* every Flux linear has a bias */
}

static mdt_status add_vec(mdt_wtable *t, const float **v, const char *name, int64_t n) {
    return mdt_wtable_add(t, name, 1, n, 0, MDT_TP_REPLICATED, v);
}

static mdt_status flux_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    flux *f = impl;
    int64_t ax[FLUX_MAX_AXES] = {0};
    int nax = FLUX_MAX_AXES;
    MDT_TRY(mdt_cfg_int(cfg, "patch_size", 0, 1, &f->patch));
    MDT_TRY(mdt_cfg_int(cfg, "in_channels", 0, 64, &f->in_ch));
    MDT_TRY(mdt_cfg_int(cfg, "out_channels", 0, 0, &f->out_ch));
    MDT_TRY(mdt_cfg_int(cfg, "num_layers", 0, 19, &f->layers));
    MDT_TRY(mdt_cfg_int(cfg, "num_single_layers", 0, 38, &f->single_layers));
    MDT_TRY(mdt_cfg_int(cfg, "attention_head_dim", 0, 128, &f->head_dim));
    MDT_TRY(mdt_cfg_int(cfg, "num_attention_heads", 0, 24, &f->heads));
    MDT_TRY(mdt_cfg_int(cfg, "joint_attention_dim", 0, 4096, &f->joint_dim));
    MDT_TRY(mdt_cfg_int(cfg, "pooled_projection_dim", 0, 768, &f->pooled_dim));
    MDT_TRY(mdt_cfg_bool(cfg, "guidance_embeds", 0, &f->guidance));
    MDT_TRY(mdt_cfg_int_array(cfg, "axes_dims_rope", ax, &nax));
    if (nax == 0) {
        ax[0] = 16, ax[1] = 56, ax[2] = 56;
        nax = 3;
    }
    if (f->out_ch == 0)
        f->out_ch = f->in_ch;
    if (f->patch < 1 || f->in_ch < 1 || f->out_ch < 1 || f->layers < 0 || f->single_layers < 0 ||
        f->head_dim < 2 || f->heads < 1 || f->joint_dim < 1 || f->pooled_dim < 1)
        return MDT_FAIL(MDT_E_INVALID, "config.json: Flux sizes must be positive");
    const int64_t dims[] = {f->patch,
                            f->in_ch,
                            f->out_ch,
                            f->head_dim,
                            f->heads,
                            f->joint_dim,
                            f->pooled_dim,
                            (f->heads <= MDT_MAX_DIM && f->head_dim <= MDT_MAX_DIM)
                                ? f->heads * f->head_dim
                                : MDT_MAX_DIM + 1};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i] > MDT_MAX_DIM)
            return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: a Flux size of %lld exceeds %lld",
                            (long long)dims[i], (long long)MDT_MAX_DIM);
    if (f->layers > 64 || f->single_layers > 128)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most 64 double and 128 single blocks");
    int64_t axsum = 0;
    for (int i = 0; i < nax; i++) {
        if (ax[i] <= 0 || ax[i] % 2)
            return MDT_FAIL(MDT_E_INVALID,
                            "config.json: axes_dims_rope[%d] = %lld must be even "
                            "and positive",
                            i, (long long)ax[i]);
        axsum += ax[i];
    }
    if (axsum != f->head_dim)
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: axes_dims_rope sum to %lld but attention_head_dim is %lld",
                        (long long)axsum, (long long)f->head_dim);
    f->naxes = nax;
    memcpy(f->axes, ax, sizeof ax);
    f->inner = f->heads * f->head_dim;
    f->mlp_hidden = 4 * f->inner;
    f->dbl = f->dbl_store;
    f->sgl = f->sgl_store;

    const int64_t C = f->inner, M = f->mlp_hidden, D = f->head_dim;
    char nm[MDT_NAME_MAX];
    MDT_TRY(add_lin(t, &f->t_lin1, "time_text_embed.timestep_embedder.linear_1", C, 256,
                    MDT_TP_REPLICATED));
    MDT_TRY(add_lin(t, &f->t_lin2, "time_text_embed.timestep_embedder.linear_2", C, C,
                    MDT_TP_REPLICATED));
    if (f->guidance) {
        MDT_TRY(add_lin(t, &f->g_lin1, "time_text_embed.guidance_embedder.linear_1", C, 256,
                        MDT_TP_REPLICATED));
        MDT_TRY(add_lin(t, &f->g_lin2, "time_text_embed.guidance_embedder.linear_2", C, C,
                        MDT_TP_REPLICATED));
    }
    MDT_TRY(add_lin(t, &f->p_lin1, "time_text_embed.text_embedder.linear_1", C, f->pooled_dim,
                    MDT_TP_REPLICATED));
    MDT_TRY(
        add_lin(t, &f->p_lin2, "time_text_embed.text_embedder.linear_2", C, C, MDT_TP_REPLICATED));
    MDT_TRY(add_lin(t, &f->ctx_emb, "context_embedder", C, f->joint_dim, MDT_TP_REPLICATED));
    MDT_TRY(add_lin(t, &f->x_emb, "x_embedder", C, f->in_ch, MDT_TP_REPLICATED));
    for (int64_t i = 0; i < f->layers; i++) {
        flux_double *b = &f->dbl[i];
        const struct {
            mdt_lin *l;
            const char *sfx;
            int64_t out, in;
            mdt_tp_style st;
        } lins[] = {
            {&b->norm1, "norm1.linear", 6 * C, C, MDT_TP_REPLICATED_INPUT_ROWWISE},
            {&b->norm1_ctx, "norm1_context.linear", 6 * C, C, MDT_TP_REPLICATED_INPUT_ROWWISE},
            {&b->to_q, "attn.to_q", C, C, MDT_TP_COLWISE},
            {&b->to_k, "attn.to_k", C, C, MDT_TP_COLWISE},
            {&b->to_v, "attn.to_v", C, C, MDT_TP_COLWISE},
            {&b->to_out, "attn.to_out.0", C, C, MDT_TP_ROWWISE},
            {&b->add_q, "attn.add_q_proj", C, C, MDT_TP_COLWISE},
            {&b->add_k, "attn.add_k_proj", C, C, MDT_TP_COLWISE},
            {&b->add_v, "attn.add_v_proj", C, C, MDT_TP_COLWISE},
            {&b->to_add_out, "attn.to_add_out", C, C, MDT_TP_ROWWISE},
            {&b->ff0, "ff.net.0.proj", M, C, MDT_TP_COLWISE},
            {&b->ff2, "ff.net.2", C, M, MDT_TP_ROWWISE},
            {&b->ffc0, "ff_context.net.0.proj", M, C, MDT_TP_COLWISE},
            {&b->ffc2, "ff_context.net.2", C, M, MDT_TP_ROWWISE},
        };
        for (size_t j = 0; j < sizeof lins / sizeof lins[0]; j++) {
            snprintf(nm, sizeof nm, "transformer_blocks.%lld.%s", (long long)i, lins[j].sfx);
            MDT_TRY(add_lin(t, lins[j].l, nm, lins[j].out, lins[j].in, lins[j].st));
        }
        const struct {
            const float **v;
            const char *sfx;
        } vecs[] = {{&b->norm_q, "attn.norm_q.weight"},
                    {&b->norm_k, "attn.norm_k.weight"},
                    {&b->norm_added_q, "attn.norm_added_q.weight"},
                    {&b->norm_added_k, "attn.norm_added_k.weight"}};
        for (size_t j = 0; j < sizeof vecs / sizeof vecs[0]; j++) {
            snprintf(nm, sizeof nm, "transformer_blocks.%lld.%s", (long long)i, vecs[j].sfx);
            MDT_TRY(add_vec(t, vecs[j].v, nm, D));
        }
    }
    for (int64_t i = 0; i < f->single_layers; i++) {
        flux_single *b = &f->sgl[i];
        const struct {
            mdt_lin *l;
            const char *sfx;
            int64_t out, in;
            mdt_tp_style st;
        } lins[] = {
            {&b->norm, "norm.linear", 3 * C, C, MDT_TP_REPLICATED_INPUT_ROWWISE},
            {&b->to_q, "attn.to_q", C, C, MDT_TP_COLWISE},
            {&b->to_k, "attn.to_k", C, C, MDT_TP_COLWISE},
            {&b->to_v, "attn.to_v", C, C, MDT_TP_COLWISE},
            {&b->proj_mlp, "proj_mlp", M, C, MDT_TP_COLWISE},
            {&b->proj_out, "proj_out", C, C + M, MDT_TP_PACKED_ROWWISE},
        };
        for (size_t j = 0; j < sizeof lins / sizeof lins[0]; j++) {
            snprintf(nm, sizeof nm, "single_transformer_blocks.%lld.%s", (long long)i, lins[j].sfx);
            MDT_TRY(add_lin(t, lins[j].l, nm, lins[j].out, lins[j].in, lins[j].st));
        }
        /* proj_out's input is [attn heads | mlp hidden]: two blocks, each sharded on its own */
        mdt_weight_spec *po = &t->specs[t->n - 2];
        po->nblocks = 2, po->blocks[0] = C, po->blocks[1] = M;
        snprintf(nm, sizeof nm, "single_transformer_blocks.%lld.attn.norm_q.weight", (long long)i);
        MDT_TRY(add_vec(t, &b->norm_q, nm, D));
        snprintf(nm, sizeof nm, "single_transformer_blocks.%lld.attn.norm_k.weight", (long long)i);
        MDT_TRY(add_vec(t, &b->norm_k, nm, D));
    }
    MDT_TRY(add_lin(t, &f->norm_out, "norm_out.linear", 2 * C, C, MDT_TP_REPLICATED_INPUT_ROWWISE));
    MDT_TRY(add_lin(t, &f->proj_out, "proj_out", f->patch * f->patch * f->out_ch, C,
                    MDT_TP_REPLICATED));
    return MDT_OK;
}

/* ---- pieces of the forward ---- */

/* e [B, 256] = [cos(t f), sin(t f)], f_i = exp(-ln(1e4) i / 128), t already x1000 (float32 math
 * like torch's get_timestep_embedding). */
static void timestep_proj(const float *t, int64_t B, float *e) {
    for (int64_t b = 0; b < B; b++)
        for (int i = 0; i < 128; i++) {
            float fr = expf(-logf(10000.0f) * (float)i / 128.0f);
            float arg = t[b] * fr;
            e[b * 256 + i] = cosf(arg);
            e[b * 256 + 128 + i] = sinf(arg);
        }
}

/* y[M, out] = lin2(SiLU(lin1(x[M, in]))) with scratch h[M, lin1.out] */
static void mlp2(const mdt_lin *l1, const mdt_lin *l2, const float *x, int64_t M, float *h,
                 float *y) {
    mdt_k_linear(x, l1->in, l1->w, l1->wh, l1->b, h, l1->out, M, l1->in, l1->out);
    mdt_k_silu(h, M * l1->out);
    mdt_k_linear(h, l2->in, l2->w, l2->wh, l2->b, y, l2->out, M, l2->in, l2->out);
}

/* Rotary columns for ids [S, naxes] -> cos/sin [S, D]: per axis of width d, pair j has frequency
 * 1/1e4^(2j/d), each value repeated for the two channels of its pair; angles in float64 like
 * diffusers on CPU/CUDA. col_axis/col_freq [D]: the id column and frequency of each channel. */
static void rope_columns(const flux *f, int32_t *col_axis, double *col_freq) {
    int64_t off = 0;
    for (int a = 0; a < f->naxes; a++) {
        const int64_t d = f->axes[a];
        for (int64_t j = 0; j < d / 2; j++) {
            const double fr = 1.0 / pow(10000.0, (double)(2 * j) / (double)d);
            col_axis[off + 2 * j] = col_axis[off + 2 * j + 1] = a;
            col_freq[off + 2 * j] = col_freq[off + 2 * j + 1] = fr;
        }
        off += d;
    }
}

typedef struct flux_act {
    int64_t B, Si, St, S;
    int T, k;                   /* TP degree and shard index */
    mdt_mesh *mesh;             /* NULL when T = 1 */
    int64_t Cl, Ml, Hl;         /* local widths: C/T, 4C/T, heads/T */
    const float *silu_temb;     /* [B, C] replicated */
    const float *cos_t, *sin_t; /* [S, D], text rows first */
    float *q, *k_, *v;          /* [B, H/T, S, D] head-major */
    mdt_mesh *cp;               /* the mesh when the sequence is split (P > 1), else NULL */
    mdt_arena *ar;              /* activations and attention scratch */
} flux_act;

static mdt_status row_linear(const flux_act *A, const mdt_lin *l, const float *x, int64_t ldx,
                             int64_t K_local, float *y, int64_t M) {
    return mdt_row_linear(A->mesh, A->T, l, x, ldx, K_local, y, M);
}

/* AdaLN projection of the replicated SiLU(temb) [B, C]: this rank multiplies input features
 * [k C/T, (k+1) C/T) by its weight columns; y [B, out] after the all-reduce. */
static mdt_status adaln(const flux *f, const flux_act *A, const mdt_lin *l, float *y) {
    return row_linear(A, l, A->silu_temb + (int64_t)A->k * A->Cl, f->inner, A->Cl, y, A->B);
}

/* Projects rows of `src` [B, n, C] with the colwise (local heads) q/k/v weights into head-major
 * [B, H/T, S, D] at sequence offset s0, applying the per-head RMSNorm to q and k and RoPE (rows
 * s0.. of the tables) to both. */
static void project_qkv(const flux *f, const flux_act *A, const float *src, int64_t n, int64_t s0,
                        const mdt_lin *lq, const mdt_lin *lk, const mdt_lin *lv, const float *nq,
                        const float *nk, float *tmp) {
    const int64_t C = f->inner, H = A->Hl, D = f->head_dim, S = A->S, Cl = A->Cl;
    const mdt_lin *lins[3] = {lq, lk, lv};
    float *dst[3] = {A->q, A->k_, A->v};
    const float *norms[3] = {nq, nk, NULL};
    mdt_k_shared_begin(src, C, A->B * n, C); /* one bf16 rounding of src for the three */
    for (int j = 0; j < 3; j++) {
        mdt_k_linear(src, C, lins[j]->w, lins[j]->wh, lins[j]->b, tmp, Cl, A->B * n, C,
                     Cl); // [B*n, C/T]
        for (int64_t b = 0; b < A->B; b++)
            mdt_k_heads_prepare(tmp + b * n * Cl, Cl, n, H, D, norms[j], k_eps,
                                j < 2 ? A->cos_t + s0 * D : NULL, j < 2 ? A->sin_t + s0 * D : NULL,
                                D, MDT_ROPE_INTERLEAVED, dst[j] + b * H * S * D, S,
                                s0); // [H/T, S, D] rows s0..s0+n
    }
    mdt_k_shared_end();
}

/* Joint attention of the local rows over the whole sequence (spread over the CP ranks) on the
 * local heads; out [B, S/P, ld] token-major, the heads at columns [0, C/T). */
static mdt_status attend(const flux *f, const flux_act *A, float *out, int64_t ld) {
    const int64_t H = A->Hl, D = f->head_dim, S = A->S;
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t b = 0; b < A->B; b++)
        MDT_TRY(mdt_attention(A->cp, A->ar, A->q + b * H * S * D, A->k_ + b * H * S * D,
                              A->v + b * H * S * D, H, S, D, scale, out + b * S * ld,
                              ld)); // [S/P, C/T]
    return MDT_OK;
}

/* x [B, n, C] += gate * FF(LN(x) (1 + scale) + shift), the mlp half of a double block:
 * net.0 colwise (local 4C/T features), GELU, net.2 rowwise + all-reduce. */
static mdt_status ff_residual(const flux *f, const flux_act *A, float *x, int64_t n,
                              const float *mod, const mdt_lin *l0, const mdt_lin *l2, float *nbuf,
                              float *hbuf, float *ybuf) {
    const int64_t C = f->inner, B = A->B, Ml = A->Ml;
    for (int64_t b = 0; b < B; b++)
        mdt_k_layernorm_modulate(x + b * n * C, nbuf + b * n * C, n, C, k_eps,
                                 mod + b * 6 * C + 3 * C, mod + b * 6 * C + 4 * C); // [n, C]
    mdt_k_linear(nbuf, C, l0->w, l0->wh, l0->b, hbuf, Ml, B * n, C, Ml);            // [B*n, 4C/T]
    mdt_k_gelu_rows(hbuf, Ml, B * n, Ml);
    MDT_TRY(row_linear(A, l2, hbuf, Ml, Ml, ybuf, B * n)); // [B*n, C]
    for (int64_t b = 0; b < B; b++)
        mdt_k_gate_residual(x + b * n * C, ybuf + b * n * C, C, mod + b * 6 * C + 5 * C, n, C);
    return MDT_OK;
}

static mdt_status double_block(const flux *f, const flux_double *blk, const flux_act *A, float *x,
                               float *c, mdt_arena *ar) {
    const int64_t C = f->inner, B = A->B, Si = A->Si, St = A->St, S = A->S, Cl = A->Cl;
    float *mod = mdt_arena_floats(ar, B * 6 * C);    // [B, 6C] image modulation
    float *cmod = mdt_arena_floats(ar, B * 6 * C);   // [B, 6C] text modulation
    float *nx = mdt_arena_floats(ar, B * Si * C);    // [B, Si, C]
    float *nc = mdt_arena_floats(ar, B * St * C);    // [B, St, C]
    float *tmp = mdt_arena_floats(ar, B * S * C);    // [B*max(Si,St), C] projection scratch
    float *ao = mdt_arena_floats(ar, B * S * Cl);    // [B, S, C/T] attention output
    float *hb = mdt_arena_floats(ar, B * S * A->Ml); // [B*n, 4C/T]
    if (!mod || !cmod || !nx || !nc || !tmp || !ao || !hb)
        return MDT_E_NOMEM;
    MDT_TRY(adaln(f, A, &blk->norm1, mod));      // [B, 6C]
    MDT_TRY(adaln(f, A, &blk->norm1_ctx, cmod)); // [B, 6C]
    for (int64_t b = 0; b < B; b++) {
        mdt_k_layernorm_modulate(x + b * Si * C, nx + b * Si * C, Si, C, k_eps, mod + b * 6 * C,
                                 mod + b * 6 * C + C); // [Si, C]
        mdt_k_layernorm_modulate(c + b * St * C, nc + b * St * C, St, C, k_eps, cmod + b * 6 * C,
                                 cmod + b * 6 * C + C); // [St, C]
    }
    /* joint sequence: text rows [0, St), image rows [St, S) */
    project_qkv(f, A, nc, St, 0, &blk->add_q, &blk->add_k, &blk->add_v, blk->norm_added_q,
                blk->norm_added_k, tmp);
    project_qkv(f, A, nx, Si, St, &blk->to_q, &blk->to_k, &blk->to_v, blk->norm_q, blk->norm_k,
                tmp);
    MDT_TRY(attend(f, A, ao, Cl)); // [B, S/P, C/T]
    for (int64_t b = 0; b < B; b++) {
        MDT_TRY(row_linear(A, &blk->to_out, ao + (b * S + St) * Cl, Cl, Cl, tmp, Si)); // [Si, C]
        mdt_k_gate_residual(x + b * Si * C, tmp, C, mod + b * 6 * C + 2 * C, Si, C);
        MDT_TRY(row_linear(A, &blk->to_add_out, ao + b * S * Cl, Cl, Cl, tmp, St)); // [St, C]
        mdt_k_gate_residual(c + b * St * C, tmp, C, cmod + b * 6 * C + 2 * C, St, C);
    }
    MDT_TRY(ff_residual(f, A, x, Si, mod, &blk->ff0, &blk->ff2, nx, hb, tmp));
    return ff_residual(f, A, c, St, cmod, &blk->ffc0, &blk->ffc2, nc, hb, tmp);
}

/* h [B, S, C] += gate * proj_out([attn(n) | GELU(proj_mlp(n))]), n = LN(h)(1+scale)+shift */
static mdt_status single_block(const flux *f, const flux_single *blk, const flux_act *A, float *h,
                               mdt_arena *ar) {
    const int64_t C = f->inner, Cl = A->Cl, Ml = A->Ml, B = A->B, S = A->S, W = Cl + Ml;
    float *mod = mdt_arena_floats(ar, B * 3 * C); // [B, 3C] shift, scale, gate
    float *n = mdt_arena_floats(ar, B * S * C);   // [B, S, C]
    float *cat = mdt_arena_floats(ar, B * S * W); // [B, S, (C + 4C)/T] = [attn | mlp] local
    float *tmp = mdt_arena_floats(ar, B * S * C); // [B*S, C]
    if (!mod || !n || !cat || !tmp)
        return MDT_E_NOMEM;
    MDT_TRY(adaln(f, A, &blk->norm, mod)); // [B, 3C]
    for (int64_t b = 0; b < B; b++)
        mdt_k_layernorm_modulate(h + b * S * C, n + b * S * C, S, C, k_eps, mod + b * 3 * C,
                                 mod + b * 3 * C + C); // [S, C]
    mdt_k_shared_begin(n, C, B * S, C); /* n feeds proj_mlp and q, k, v: rounded once */
    mdt_k_linear(n, C, blk->proj_mlp.w, blk->proj_mlp.wh, blk->proj_mlp.b, cat + Cl, W, B * S, C,
                 Ml);                        // [B*S, 4C/T] in columns [C/T, W)
    mdt_k_gelu_rows(cat + Cl, W, B * S, Ml); // [B*S, 4C/T] in columns [C/T, W)
    project_qkv(f, A, n, S, 0, &blk->to_q, &blk->to_k, &blk->to_v, blk->norm_q, blk->norm_k, tmp);
    mdt_k_shared_end();
    MDT_TRY(attend(f, A, cat, W)); // columns [0, C/T) of cat
    /* packed rowwise: the local weight columns are [attn block k | mlp block k], like cat */
    MDT_TRY(row_linear(A, &blk->proj_out, cat, W, W, tmp, B * S)); // [B*S, C]
    for (int64_t b = 0; b < B; b++)
        mdt_k_gate_residual(h + b * S * C, tmp + b * S * C, C, mod + b * 3 * C + 2 * C, S, C);
    return MDT_OK;
}

/* Copies rows [r0, r0 + n) of every batch element of x [B, rows, w] into dst [B, n, w]. */
static void slice_rows(const float *x, int64_t B, int64_t rows, int64_t w, int64_t r0, int64_t n,
                       float *dst) {
    for (int64_t b = 0; b < B; b++)
        memcpy(dst + b * n * w, x + (b * rows + r0) * w, sizeof(float) * (size_t)(n * w));
}

/* No silent degrade: what this rank's attention must have processed in one forward under its
 * layout (each query row once, over its head group and its sequence block). */
static mdt_status check_promise(const flux *f, const mdt_model *m, const flux_act *A, int64_t Si,
                                int64_t St) {
    const mdt_mesh *mesh = m->mesh;
    const int R = mesh ? mesh->R : 1, U = mesh ? mesh->U : 1, P = R * U;
    const int r = mesh ? mesh->r : 0, u = mesh ? mesh->u : 0;
    int64_t h0, hn, L = 0, s0, n;
    mdt_split_range(A->Hl, U, u, &h0, &hn);
    for (int j = 0; j < U; j++) { /* my sequence block: the chunks of my Ulysses group */
        mdt_split_range(St, P, r * U + j, &s0, &n);
        L += n;
        mdt_split_range(Si, P, r * U + j, &s0, &n);
        L += n;
    }
    int64_t i0, ni;
    mdt_split_range(Si, P, mesh ? mesh->cp_index : 0, &i0, &ni);
    const int64_t calls = (f->layers + f->single_layers) * A->B;
    mdt_promise p = {.want_q = calls * hn * L,
                     .want_kv = calls * hn * (Si + St),
                     .whole_q = calls * A->Hl * (Si + St),
                     .unscattered_q = calls * A->Hl * L,
                     .ringless_kv = calls * hn * L,
                     .owes = {mesh && mesh->T > 1, R > 1 && hn > 0, U > 1, P > 1 && ni > 0}};
    return mdt_model_check_promise(m, &p);
}

static mdt_status flux_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const flux *f = m->impl;
    mdt_arena *ar = &m->arena, *ha = &m->harena; /* activations; host-side inputs and tables */
    const double t_prep = mdt_now();
    mdt_mesh *mesh = m->mesh;
    const int64_t C = f->inner, D = f->head_dim, H = f->heads / m->T;
    flux_act A = {0};
    A.T = m->T, A.k = m->tp_index, A.mesh = mesh, A.ar = ar;
    A.Cl = C / m->T, A.Ml = f->mlp_hidden / m->T, A.Hl = H;
    /* CP plan: image and text tokens (and their ids) split into P chunks, chunk = cp index */
    int P, chunk;
    mdt_model_cp_split(m, &P, &chunk);
    A.cp = P > 1 ? mesh : NULL;
    const int64_t B = mdt_input_dim(in, "hidden_states", 0);
    const int64_t Si = mdt_input_dim(in, "hidden_states", 1);
    const int64_t St = mdt_input_dim(in, "encoder_hidden_states", 1);
    if (B < 1 || Si < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'hidden_states' must be [B, S_img, %lld] with "
                        "B, S_img >= 1",
                        (long long)f->in_ch);
    if (St < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'encoder_hidden_states' must be [B, S_txt, %lld] "
                        "with S_txt >= 1",
                        (long long)f->joint_dim);
    const float *hs_full, *ehs_full;
    float *pooled, *ts, *img_full, *txt_full, *g = NULL;
    MDT_TRY(mdt_input_f32_view(in, "hidden_states", 3, (int64_t[]){B, Si, f->in_ch}, ha, &hs_full));
    MDT_TRY(mdt_input_f32_view(in, "encoder_hidden_states", 3, (int64_t[]){B, St, f->joint_dim}, ha,
                               &ehs_full));
    MDT_TRY(mdt_input_f32(in, "pooled_projections", 2, (int64_t[]){B, f->pooled_dim}, ha, &pooled));
    MDT_TRY(mdt_input_f32(in, "timestep", 1, (int64_t[]){B}, ha, &ts));
    /* diffusers accepts 3-D ids (deprecated) and uses batch 0; so do we */
    int img3 = mdt_input_dim(in, "img_ids", 2) >= 0, txt3 = mdt_input_dim(in, "txt_ids", 2) >= 0;
    MDT_TRY(mdt_input_f32(in, "img_ids", img3 ? 3 : 2,
                          img3 ? (int64_t[]){-1, Si, f->naxes} : (int64_t[]){Si, f->naxes}, ha,
                          &img_full));
    MDT_TRY(mdt_input_f32(in, "txt_ids", txt3 ? 3 : 2,
                          txt3 ? (int64_t[]){-1, St, f->naxes} : (int64_t[]){St, f->naxes}, ha,
                          &txt_full));
    if (f->guidance)
        MDT_TRY(mdt_input_f32(in, "guidance", 1, (int64_t[]){B}, ha, &g));
    int64_t si0, sic, st0, stc;
    mdt_split_range(Si, P, chunk, &si0, &sic);
    mdt_split_range(St, P, chunk, &st0, &stc);
    A.B = B, A.Si = sic, A.St = stc, A.S = sic + stc;
    const int64_t S = A.S;
    /* this chunk's rows of the inputs (the inputs themselves when the sequence is whole) */
    float *hs_c = P > 1 ? mdt_arena_floats(ha, B * sic * f->in_ch) : NULL;      // [B, Si/P, in]
    float *ehs_c = P > 1 ? mdt_arena_floats(ha, B * stc * f->joint_dim) : NULL; // [B, St/P, j]
    const float *hs_h = P > 1 ? hs_c : hs_full, *ehs_h = P > 1 ? ehs_c : ehs_full;
    float *img_ids = mdt_arena_floats(ha, sic * f->naxes);            // [Si/P, axes] host
    float *txt_ids = mdt_arena_floats(ha, stc * f->naxes);            // [St/P, axes] host
    float *e256_h = mdt_arena_floats(ha, 2 * B * 256);                // [2, B, 256] host: t, g
    float *ids = mdt_arena_floats(ha, (sic + stc) * f->naxes);        // [S/P, axes] text first
    int32_t *col_axis = (int32_t *)(void *)mdt_arena_floats(ha, D);   // [D] host
    double *col_freq = (double *)(void *)mdt_arena_floats(ha, 2 * D); // [D] host
    if (!hs_h || !ehs_h || !img_ids || !txt_ids || !e256_h || !ids || !col_axis || !col_freq)
        return MDT_E_NOMEM;
    if (P > 1) {
        slice_rows(hs_full, B, Si, f->in_ch, si0, sic, hs_c);
        slice_rows(ehs_full, B, St, f->joint_dim, st0, stc, ehs_c);
    }
    slice_rows(img_full, 1, Si, f->naxes, si0, sic, img_ids);
    slice_rows(txt_full, 1, St, f->naxes, st0, stc, txt_ids);
    for (int64_t b = 0; b < B; b++)
        ts[b] = ts[b] * 1000.0f;
    timestep_proj(ts, B, e256_h);
    if (f->guidance) {
        for (int64_t b = 0; b < B; b++)
            g[b] = g[b] * 1000.0f;
        timestep_proj(g, B, e256_h + B * 256);
    }
    memcpy(ids, txt_ids, sizeof(float) * (size_t)(stc * f->naxes));
    memcpy(ids + stc * f->naxes, img_ids, sizeof(float) * (size_t)(sic * f->naxes));
    rope_columns(f, col_axis, col_freq);

    /* to the backend's memory (the same pointers on the CPU backend) */
    const float *hs = mdt_k_upload(ar, hs_h, sizeof(float) * (size_t)(B * sic * f->in_ch));
    const float *ehs = mdt_k_upload(ar, ehs_h, sizeof(float) * (size_t)(B * stc * f->joint_dim));
    const float *e256 = mdt_k_upload(ar, e256_h, sizeof(float) * (size_t)(2 * B * 256));
    const float *pool = mdt_k_upload(ar, pooled, sizeof(float) * (size_t)(B * f->pooled_dim));
    const float *ids_d = mdt_k_upload(ar, ids, sizeof(float) * (size_t)(S * f->naxes));
    const int32_t *cax_d = mdt_k_upload(ar, col_axis, sizeof(int32_t) * (size_t)D);
    const double *cfr_d = mdt_k_upload(ar, col_freq, sizeof(double) * (size_t)D);
    float *cos_t = mdt_arena_floats(ar, S * D);   // [S/P, D] local rows only (non-persistent)
    float *sin_t = mdt_arena_floats(ar, S * D);   // [S/P, D]
    float *hsc = mdt_arena_floats(ar, B * C);     // [B, C] scratch
    float *temb = mdt_arena_floats(ar, B * C);    // [B, C]
    float *tmp = mdt_arena_floats(ar, B * C);     // [B, C]
    float *x = mdt_arena_floats(ar, B * sic * C); // [B, Si/P, C]
    float *c = mdt_arena_floats(ar, B * stc * C); // [B, St/P, C]
    A.q = mdt_arena_floats(ar, B * H * S * D);    // [B, H/T, S/P, D]
    A.k_ = mdt_arena_floats(ar, B * H * S * D);   // [B, H/T, S/P, D]
    A.v = mdt_arena_floats(ar, B * H * S * D);    // [B, H/T, S/P, D]
    if (!hs || !ehs || !e256 || !pool || !ids_d || !cax_d || !cfr_d || !cos_t || !sin_t || !hsc ||
        !temb || !tmp || !x || !c || !A.q || !A.k_ || !A.v)
        return MDT_E_NOMEM;
    mdt_k_angle_table(ids_d, f->naxes, S, D, cax_d, cfr_d, 1, cos_t, sin_t); // [S/P, D]
    mdt_counters_get()->prep_s += mdt_now() - t_prep;

    /* conditioning: temb [B, C] = time(t) (+ guidance(g)) + text(pooled) */
    mlp2(&f->t_lin1, &f->t_lin2, e256, B, hsc, temb); // [B, C]
    if (f->guidance) {
        mlp2(&f->g_lin1, &f->g_lin2, e256 + B * 256, B, hsc, tmp); // [B, C]
        mdt_k_add(temb, tmp, B * C);
    }
    mlp2(&f->p_lin1, &f->p_lin2, pool, B, hsc, tmp); // [B, C]
    mdt_k_add(temb, tmp, B * C);
    mdt_k_copy2d(hsc, 0, temb, 0, 1, B * C);
    mdt_k_silu(hsc, B * C); // [B, C] SiLU(temb), the input of every AdaLN projection
    A.silu_temb = hsc;
    MDT_TRY(mdt_guard_finite(mesh, "time_text_embed", hsc, B * C));
    A.cos_t = cos_t, A.sin_t = sin_t;

    mdt_k_linear(hs, f->in_ch, f->x_emb.w, f->x_emb.wh, f->x_emb.b, x, C, B * sic, f->in_ch,
                 C); // [B, Si/P, C]
    mdt_k_linear(ehs, f->joint_dim, f->ctx_emb.w, f->ctx_emb.wh, f->ctx_emb.b, c, C, B * stc,
                 f->joint_dim, C); // [B, St/P, C]
    MDT_TRY(mdt_guard_finite(mesh, "x_embedder", x, B * sic * C));
    MDT_TRY(mdt_guard_finite(mesh, "context_embedder", c, B * stc * C));

    char stage[48];
    for (int64_t i = 0; i < f->layers; i++) { /* a block's scratch is reused by the next */
        mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(double_block(f, &f->dbl[i], &A, x, c, ar));
        mdt_arena_rewind(ar, mk);
        snprintf(stage, sizeof stage, "transformer_blocks.%lld", (long long)i);
        MDT_TRY(mdt_guard_finite(mesh, stage, x, B * sic * C));
        MDT_TRY(mdt_guard_finite(mesh, stage, c, B * stc * C));
        if (i == 0)
            MDT_TRY(mdt_test_fail_point(mesh, "step")); /* test-only: fail mid-step */
    }

    float *h = mdt_arena_floats(ar, B * S * C); // [B, S/P, C] = cat(c, x) per batch
    if (!h)
        return MDT_E_NOMEM;
    mdt_k_copy2d(h, S * C, c, stc * C, B, stc * C);           // text rows of every batch
    mdt_k_copy2d(h + stc * C, S * C, x, sic * C, B, sic * C); // image rows after them
    for (int64_t i = 0; i < f->single_layers; i++) {
        mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(single_block(f, &f->sgl[i], &A, h, ar));
        mdt_arena_rewind(ar, mk);
        snprintf(stage, sizeof stage, "single_transformer_blocks.%lld", (long long)i);
        MDT_TRY(mdt_guard_finite(mesh, stage, h, B * S * C));
    }

    /* norm_out: emb [B, 2C] = (scale, shift) -- scale first; image rows only */
    float *emb = mdt_arena_floats(ar, B * 2 * C);  // [B, 2C]
    float *xn = mdt_arena_floats(ar, B * sic * C); // [B, Si/P, C]
    if (!emb || !xn)
        return MDT_E_NOMEM;
    MDT_TRY(adaln(f, &A, &f->norm_out, emb)); // [B, 2C]
    for (int64_t b = 0; b < B; b++)
        mdt_k_layernorm_modulate(h + (b * S + stc) * C, xn + b * sic * C, sic, C, k_eps,
                                 emb + b * 2 * C + C, emb + b * 2 * C); // [Si/P, C]
    const int64_t O = f->proj_out.out;
    float *ol = mdt_arena_floats(ar, B * sic * O); // [B, Si/P, O] local image rows
    float *of = mdt_arena_floats(ar, B * Si * O);  // [B, Si, O] all image rows
    mdt_tensor *o;
    if (!ol || !of)
        return MDT_E_NOMEM;
    mdt_k_linear(xn, C, f->proj_out.w, f->proj_out.wh, f->proj_out.b, ol, O, B * sic, C,
                 O); // [B, Si/P, O]
    MDT_TRY(mdt_guard_finite(mesh, "proj_out", ol, B * sic * O));
    MDT_TRY(mdt_tensor_set_add(out, "sample", MDT_F32, 3, (int64_t[]){B, Si, O}, &o));
    MDT_TRY(mdt_cp_gather_rows(mesh, ar, P, B, Si, O, ol, of)); // image rows, chunk order
    mdt_k_to_host(o->data, of, sizeof(float) * (size_t)(B * Si * O));
    return check_promise(f, m, &A, Si, St);
}

static mdt_status flux_check_layout(const void *impl, int T, int R, int U) {
    const flux *f = impl;
    (void)R, (void)U;
    if (f->heads % T != 0)
        return MDT_FAIL(MDT_E_INVALID, "tp=%d does not divide %lld attention heads", T,
                        (long long)f->heads);
    return MDT_OK;
}

/* ---- random inputs ---- */
static mdt_status add_normal(mdt_tensor_set *out, const char *name, int ndim, const int64_t *shape,
                             mdt_rng *rng) {
    mdt_tensor *t;
    MDT_TRY(mdt_tensor_set_add(out, name, MDT_F32, ndim, shape, &t));
    float *d = t->data;
    for (int64_t i = 0; i < mdt_tensor_numel(t); i++)
        d[i] = (float)mdt_rng_normal(rng);
    return MDT_OK;
}

static mdt_status flux_make_inputs(const void *impl, const mdt_inputs_params *p,
                                   mdt_tensor_set *out) {
    const flux *f = impl;
    mdt_rng rng;
    mdt_tensor *t;
    const int64_t B = p->batch > 0 ? p->batch : 1;
    const int64_t Si = p->img_tokens > 0 ? p->img_tokens : 16;
    const int64_t St = p->txt_tokens > 0 ? p->txt_tokens : 8;
    mdt_rng_seed(&rng, p->seed);
    MDT_TRY(add_normal(out, "hidden_states", 3, (int64_t[]){B, Si, f->in_ch}, &rng));
    MDT_TRY(add_normal(out, "encoder_hidden_states", 3, (int64_t[]){B, St, f->joint_dim}, &rng));
    MDT_TRY(add_normal(out, "pooled_projections", 2, (int64_t[]){B, f->pooled_dim}, &rng));
    MDT_TRY(mdt_tensor_set_add(out, "timestep", MDT_F32, 1, (int64_t[]){B}, &t));
    for (int64_t b = 0; b < B; b++)
        ((float *)t->data)[b] = (float)p->timestep;
    /* image ids: the latent grid (0, row, col) of a near-square layout, as Flux pipelines build */
    int64_t w = (int64_t)ceil(sqrt((double)Si));
    MDT_TRY(mdt_tensor_set_add(out, "img_ids", MDT_F32, 2, (int64_t[]){Si, f->naxes}, &t));
    for (int64_t s = 0; s < Si; s++) {
        const int64_t row = s / w, col = s % w;
        for (int a = 0; a < f->naxes; a++)
            ((float *)t->data)[s * f->naxes + a] = a == 1 ? (float)row : a == 2 ? (float)col : 0.0f;
    }
    MDT_TRY(mdt_tensor_set_add(out, "txt_ids", MDT_F32, 2, (int64_t[]){St, f->naxes}, &t));
    if (f->guidance) {
        MDT_TRY(mdt_tensor_set_add(out, "guidance", MDT_F32, 1, (int64_t[]){B}, &t));
        for (int64_t b = 0; b < B; b++)
            ((float *)t->data)[b] = (float)p->guidance;
    }
    return MDT_OK;
}

static const char *flux_preset(const char *name) {
    if (strcmp(name, "tiny") == 0) /* diffusers' own test config */
        return "{\n  \"_class_name\": \"FluxTransformer2DModel\",\n  \"patch_size\": 1,\n"
               "  \"in_channels\": 4,\n  \"out_channels\": null,\n  \"num_layers\": 1,\n"
               "  \"num_single_layers\": 1,\n  \"attention_head_dim\": 16,\n"
               "  \"num_attention_heads\": 2,\n  \"joint_attention_dim\": 32,\n"
               "  \"pooled_projection_dim\": 32,\n  \"guidance_embeds\": false,\n"
               "  \"axes_dims_rope\": [4, 4, 8]\n}\n";
    if (strcmp(name, "medium") == 0) /* the benchmark shape: inner 1024, 8 heads, 2 + 4 blocks */
        return "{\n  \"_class_name\": \"FluxTransformer2DModel\",\n  \"patch_size\": 1,\n"
               "  \"in_channels\": 64,\n  \"out_channels\": null,\n  \"num_layers\": 2,\n"
               "  \"num_single_layers\": 4,\n  \"attention_head_dim\": 128,\n"
               "  \"num_attention_heads\": 8,\n  \"joint_attention_dim\": 4096,\n"
               "  \"pooled_projection_dim\": 768,\n  \"guidance_embeds\": true,\n"
               "  \"axes_dims_rope\": [16, 56, 56]\n}\n";
    if (strcmp(name, "block") == 0) /* one single block of the real Flux.1: 24 heads of 128 */
        return "{\n  \"_class_name\": \"FluxTransformer2DModel\",\n  \"patch_size\": 1,\n"
               "  \"in_channels\": 64,\n  \"out_channels\": null,\n  \"num_layers\": 0,\n"
               "  \"num_single_layers\": 1,\n  \"attention_head_dim\": 128,\n"
               "  \"num_attention_heads\": 24,\n  \"joint_attention_dim\": 4096,\n"
               "  \"pooled_projection_dim\": 768,\n  \"guidance_embeds\": true,\n"
               "  \"axes_dims_rope\": [16, 56, 56]\n}\n";
    if (strcmp(name, "narrow") == 0) /* long-sequence memory checks: 1 head of 16, 1 + 1 blocks */
        return "{\n  \"_class_name\": \"FluxTransformer2DModel\",\n  \"patch_size\": 1,\n"
               "  \"in_channels\": 4,\n  \"out_channels\": null,\n  \"num_layers\": 1,\n"
               "  \"num_single_layers\": 1,\n  \"attention_head_dim\": 16,\n"
               "  \"num_attention_heads\": 1,\n  \"joint_attention_dim\": 8,\n"
               "  \"pooled_projection_dim\": 8,\n  \"guidance_embeds\": false,\n"
               "  \"axes_dims_rope\": [4, 4, 8]\n}\n";
    return NULL;
}

const mdt_family mdt_family_flux = {
    .name = "flux",
    .class_name = "FluxTransformer2DModel",
    .impl_size = sizeof(flux),
    .configure = flux_configure,
    .check_layout = flux_check_layout,
    .forward = flux_forward,
    .make_inputs = flux_make_inputs,
    .preset = flux_preset,
    .cp_plan = &k_flux_cp_plan,
    .latent_input = "hidden_states",
    .timestep_input = "timestep",
    .output = "sample",
};
