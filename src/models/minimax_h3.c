/*
 * minimax_h3.c — diffusers' MiniMaxH3Transformer3DModel (video + audio over one packed
 * sequence): config, weight table with TP styles, CP plan, forward, random inputs.
 *
 * Semantics follow diffusers (shared/reference/parallel-semantics.md §8.2): per-modality input
 * projections scattered into one packed sequence by row indices; a token refiner on the text
 * (pre-norm blocks, SwiGLU, no RoPE, final RMSNorm); an unscaled sinusoidal timestep embedding
 * (cos first) through a SiLU MLP; per block an AdaLN table of (timestep, modality) rows
 * (adaln_proj: [T_n, 18 C] viewed [3 T_n, 6 C], chunk order shift, scale, gate x 2) selected per
 * row by timestep_index * 3 + token_tag; RMSNorm residual norms; per-head QK RMSNorm; rotate-half
 * RoPE on the first 6 rope_freq_dim channels of each head from (t, h, w) positions, inv_freq
 * computed here (never read from disk); SwiGLU FFN [value | gate]; norm_out shift-then-scale per
 * timestep; video and audio heads over every row, then the rows of each modality selected.
 *
 * TP: q/k/v colwise, to_out.0 rowwise, ff.net.0.proj packed colwise [value | gate], ff.net.2
 * rowwise (blocks and refiner); adaln_proj.linear and norm_out.linear replicated-input rowwise.
 * CP: the packed sequence splits after it is built (with its rope rows, adaln and timestep
 * indices); the refiner runs on the full text on every rank with plain attention (the reference
 * routes it through CP attention over identical copies: same result up to rounding); the head
 * outputs are all-gathered before the rows are selected. fp32 compute (the modules diffusers keeps
 * in fp32 are fp32 here like everything else).
 */
#include "models/model.h"

#include "attn/attn.h"
#include "backend/backend.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { H3_MAX_LAYERS = 128, H3_MAX_REFINER = 16, H3_MOD = 3 };

typedef struct h3_attn_block {
    const float *norm1, *norm2, *norm_q, *norm_k;
    mdt_lin to_q, to_k, to_v, to_out, ff0, ff2;
    mdt_lin adaln; /* transformer blocks only */
} h3_block;

typedef struct h3 {
    int64_t heads, head_dim, hidden, layers, refiner_layers, ffn, in_ch, audio_in, patch[3];
    int64_t text_dim, freq_dim, time_hidden, time_embed, rope_freq;
    double rope_theta, norm_eps, qk_eps, final_eps;
    int64_t A, Pv; /* attention inner width, video patch width */
    mdt_lin proj_in, audio_proj_in, ctx_emb, t_lin1, t_lin2, norm_out, proj_out, audio_proj_out;
    const float *final_norm, *norm_out_w;
    h3_block ref[H3_MAX_REFINER], blk[H3_MAX_LAYERS];
} h3;

static mdt_status lin(mdt_wtable *t, mdt_lin *l, const char *name, int64_t out, int64_t in,
                      mdt_tp_style st, int bias) {
    return mdt_wtable_add_linear(t, l, name, out, in, st, bias);
}

static mdt_status vec(mdt_wtable *t, const float **v, const char *prefix, const char *sfx,
                      int64_t n) {
    char nm[MDT_NAME_MAX];
    snprintf(nm, sizeof nm, "%s%s", prefix, sfx);
    return mdt_wtable_add(t, nm, 1, n, 0, MDT_TP_REPLICATED, v);
}

static mdt_status add_block(const h3 *f, mdt_wtable *t, h3_block *b, const char *pfx, int adaln) {
    char nm[MDT_NAME_MAX];
    const int64_t C = f->hidden, A = f->A, F = f->ffn;
    MDT_TRY(vec(t, &b->norm1, pfx, "norm1.weight", C));
    const struct {
        mdt_lin *l;
        const char *sfx;
        int64_t out, in;
        mdt_tp_style st;
    } ls[] = {{&b->to_q, "attn.to_q", A, C, MDT_TP_COLWISE},
              {&b->to_k, "attn.to_k", A, C, MDT_TP_COLWISE},
              {&b->to_v, "attn.to_v", A, C, MDT_TP_COLWISE},
              {&b->to_out, "attn.to_out.0", C, A, MDT_TP_ROWWISE},
              {&b->ff0, "ff.net.0.proj", 2 * F, C, MDT_TP_PACKED_COLWISE},
              {&b->ff2, "ff.net.2", C, F, MDT_TP_ROWWISE}};
    for (size_t i = 0; i < sizeof ls / sizeof ls[0]; i++) {
        snprintf(nm, sizeof nm, "%s%s", pfx, ls[i].sfx);
        MDT_TRY(lin(t, ls[i].l, nm, ls[i].out, ls[i].in, ls[i].st, 0));
        if (ls[i].st == MDT_TP_PACKED_COLWISE) { /* SwiGLU halves [value | gate] */
            mdt_weight_spec *w = &t->specs[t->n - 1];
            w->nblocks = 2, w->blocks[0] = F, w->blocks[1] = F;
        }
    }
    MDT_TRY(vec(t, &b->norm_q, pfx, "attn.norm_q.weight", f->head_dim));
    MDT_TRY(vec(t, &b->norm_k, pfx, "attn.norm_k.weight", f->head_dim));
    MDT_TRY(vec(t, &b->norm2, pfx, "norm2.weight", C));
    if (adaln) {
        snprintf(nm, sizeof nm, "%sadaln_proj.linear", pfx);
        MDT_TRY(lin(t, &b->adaln, nm, 6 * C * H3_MOD, f->time_embed,
                    MDT_TP_REPLICATED_INPUT_ROWWISE, 1));
    }
    return MDT_OK;
}

static mdt_status h3_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    h3 *f = impl;
    int np = 3;
    MDT_TRY(mdt_cfg_int(cfg, "num_attention_heads", 0, 56, &f->heads));
    MDT_TRY(mdt_cfg_int(cfg, "attention_head_dim", 0, 128, &f->head_dim));
    MDT_TRY(mdt_cfg_int(cfg, "hidden_size", 0, 5376, &f->hidden));
    MDT_TRY(mdt_cfg_int(cfg, "num_layers", 0, 50, &f->layers));
    MDT_TRY(mdt_cfg_int(cfg, "num_refiner_layers", 0, 2, &f->refiner_layers));
    MDT_TRY(mdt_cfg_int(cfg, "ffn_dim", 0, 14336, &f->ffn));
    MDT_TRY(mdt_cfg_int(cfg, "in_channels", 0, 24, &f->in_ch));
    MDT_TRY(mdt_cfg_int(cfg, "audio_in_channels", 0, 32, &f->audio_in));
    MDT_TRY(mdt_cfg_int_array(cfg, "patch_size", f->patch, &np));
    if (np == 0)
        f->patch[0] = 1, f->patch[1] = 2, f->patch[2] = 2, np = 3;
    MDT_TRY(mdt_cfg_int(cfg, "text_dim", 0, 5120, &f->text_dim));
    MDT_TRY(mdt_cfg_int(cfg, "freq_dim", 0, 256, &f->freq_dim));
    MDT_TRY(mdt_cfg_int(cfg, "time_embed_hidden_dim", 0, 5376, &f->time_hidden));
    MDT_TRY(mdt_cfg_int(cfg, "time_embed_dim", 0, 2688, &f->time_embed));
    MDT_TRY(mdt_cfg_int(cfg, "rope_freq_dim", 0, 16, &f->rope_freq));
    MDT_TRY(mdt_cfg_double(cfg, "rope_theta", 10000.0, &f->rope_theta));
    MDT_TRY(mdt_cfg_double(cfg, "norm_eps", 1e-5, &f->norm_eps));
    MDT_TRY(mdt_cfg_double(cfg, "qk_norm_eps", 1e-5, &f->qk_eps));
    MDT_TRY(mdt_cfg_double(cfg, "final_norm_eps", 1e-5, &f->final_eps));
    if (np != 3 || f->heads < 1 || f->head_dim < 2 || f->hidden < 1 || f->layers < 0 ||
        f->refiner_layers < 0 || f->ffn < 1 || f->in_ch < 1 || f->audio_in < 1 || f->text_dim < 1 ||
        f->freq_dim < 2 || f->freq_dim % 2 || f->time_hidden < 1 || f->time_embed < 1 ||
        f->rope_freq < 1 || f->patch[0] < 1 || f->patch[1] < 1 || f->patch[2] < 1)
        return MDT_FAIL(MDT_E_INVALID, "config.json: MiniMax-H3 sizes must be positive (patch_size "
                                       "three values, freq_dim even)");
    const int64_t dims[] = {f->heads,    f->head_dim,    f->hidden,     f->ffn,      f->in_ch,
                            f->audio_in, f->patch[0],    f->patch[1],   f->patch[2], f->text_dim,
                            f->freq_dim, f->time_hidden, f->time_embed, f->rope_freq};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i] > MDT_MAX_DIM)
            return MDT_FAIL(MDT_E_UNSUPPORTED,
                            "config.json: a MiniMax-H3 size of %lld exceeds %lld",
                            (long long)dims[i], (long long)MDT_MAX_DIM);
    if (f->heads * f->head_dim > MDT_MAX_DIM || f->patch[0] * f->patch[1] > MDT_MAX_DIM ||
        f->patch[0] * f->patch[1] * f->patch[2] > MDT_MAX_DIM ||
        f->in_ch * f->patch[0] * f->patch[1] * f->patch[2] > MDT_MAX_DIM)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: MiniMax-H3 widths exceed %lld",
                        (long long)MDT_MAX_DIM);
    if (6 * f->rope_freq > f->head_dim)
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: 6 x rope_freq_dim = %lld rotary channels exceed "
                        "attention_head_dim %lld",
                        (long long)(6 * f->rope_freq), (long long)f->head_dim);
    if (f->layers > H3_MAX_LAYERS || f->refiner_layers > H3_MAX_REFINER)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most %d blocks and %d refiner blocks",
                        H3_MAX_LAYERS, H3_MAX_REFINER);
    f->A = f->heads * f->head_dim;
    f->Pv = f->in_ch * f->patch[0] * f->patch[1] * f->patch[2];
    const int64_t C = f->hidden;
    char pfx[MDT_NAME_MAX];
    MDT_TRY(lin(t, &f->proj_in, "proj_in", C, f->Pv, MDT_TP_REPLICATED, 1));
    MDT_TRY(lin(t, &f->audio_proj_in, "audio_proj_in", C, f->audio_in, MDT_TP_REPLICATED, 1));
    MDT_TRY(lin(t, &f->ctx_emb, "context_embedder", C, f->text_dim, MDT_TP_REPLICATED, 1));
    MDT_TRY(lin(t, &f->t_lin1, "time_embedder.linear_1", f->time_hidden, f->freq_dim,
                MDT_TP_REPLICATED, 1));
    MDT_TRY(lin(t, &f->t_lin2, "time_embedder.linear_2", f->time_embed, f->time_hidden,
                MDT_TP_REPLICATED, 1));
    for (int64_t i = 0; i < f->refiner_layers; i++) {
        snprintf(pfx, sizeof pfx, "token_refiner.refiner_blocks.%lld.", (long long)i);
        MDT_TRY(add_block(f, t, &f->ref[i], pfx, 0));
    }
    MDT_TRY(vec(t, &f->final_norm, "token_refiner.", "final_norm.weight", C));
    for (int64_t i = 0; i < f->layers; i++) {
        snprintf(pfx, sizeof pfx, "transformer_blocks.%lld.", (long long)i);
        MDT_TRY(add_block(f, t, &f->blk[i], pfx, 1));
    }
    MDT_TRY(vec(t, &f->norm_out_w, "norm_out.", "norm.weight", C));
    MDT_TRY(lin(t, &f->norm_out, "norm_out.linear", 2 * C, f->time_embed,
                MDT_TP_REPLICATED_INPUT_ROWWISE, 1));
    MDT_TRY(lin(t, &f->proj_out, "proj_out", f->Pv, C, MDT_TP_REPLICATED, 1));
    return lin(t, &f->audio_proj_out, "audio_proj_out", f->audio_in, C, MDT_TP_REPLICATED, 1);
}

static mdt_status h3_check_layout(const void *impl, int T, int R, int U) {
    const h3 *f = impl;
    (void)R, (void)U;
    if (f->heads % T != 0)
        return MDT_FAIL(MDT_E_INVALID, "tp=%d does not divide %lld attention heads", T,
                        (long long)f->heads);
    if (f->time_embed % T != 0)
        return MDT_FAIL(MDT_E_INVALID,
                        "tp=%d does not divide time_embed_dim %lld (the input features the AdaLN "
                        "projections are sharded on)",
                        T, (long long)f->time_embed);
    return MDT_OK;
}

/* ---- forward ---- */
typedef struct h3_act {
    int64_t B, Sc; /* batch, local rows of the packed sequence */
    int T, k;
    mdt_mesh *mesh; /* TP all-reduces */
    mdt_mesh *cp;   /* attention mesh when the sequence is split, else NULL */
    int64_t Hl, Al, Fl;
    const float *silu_temb; /* [T_n, E] */
    int64_t Tn;
    mdt_arena *ar;
} h3_act;

static void linear(const mdt_lin *l, const float *x, int64_t M, int64_t out_local, float *y) {
    mdt_k_linear(x, l->in, l->w, l->wh, l->b, y, out_local, M, l->in, out_local);
}

static mdt_status row_linear(const h3_act *A, const mdt_lin *l, const float *x, int64_t ldx,
                             int64_t K_local, float *y, int64_t M) {
    return mdt_row_linear(A->mesh, A->T, l, x, ldx, K_local, y, M);
}

/* AdaLN-style projection of SiLU(temb) [T_n, E] (replicated input, sharded features). */
static mdt_status adaln(const h3 *f, const h3_act *A, const mdt_lin *l, float *y) {
    const int64_t El = f->time_embed / A->T;
    return row_linear(A, l, A->silu_temb + (int64_t)A->k * El, f->time_embed, El, y, A->Tn);
}

/* Self-attention half of a block on rows n [B, S_rows, C] (already normed and modulated):
 * returns to_out(attn) in y [B*S_rows, C]. cos/sin NULL: no RoPE (refiner). mesh NULL: local. */
static mdt_status attn_part(const h3 *f, const h3_act *A, const h3_block *b, const float *n,
                            int64_t S, const float *cos_t, const float *sin_t, mdt_mesh *mesh,
                            float *y) {
    mdt_arena *ar = A->ar;
    mdt_arena_mark mk = mdt_arena_mark_get(ar);
    const int64_t B = A->B, C = f->hidden, D = f->head_dim, H = A->Hl, Al = A->Al;
    float *tmp = mdt_arena_floats(ar, B * S * Al); // [B*S, A/T]
    float *qkv[3];
    for (int j = 0; j < 3; j++)
        qkv[j] = mdt_arena_floats(ar, B * H * S * D); // [B, H/T, S, D]
    float *ao = mdt_arena_floats(ar, B * S * Al);     // [B, S, A/T]
    if (!tmp || !qkv[0] || !qkv[1] || !qkv[2] || !ao)
        return MDT_E_NOMEM;
    const mdt_lin *ls[3] = {&b->to_q, &b->to_k, &b->to_v};
    const float *norms[3] = {b->norm_q, b->norm_k, NULL};
    for (int j = 0; j < 3; j++) {
        linear(ls[j], n, B * S, Al, tmp); // [B*S, A/T], no bias
        for (int64_t bb = 0; bb < B; bb++)
            mdt_k_heads_prepare(tmp + bb * S * Al, Al, S, H, D, norms[j], (float)f->qk_eps,
                                j < 2 ? cos_t : NULL, j < 2 ? sin_t : NULL, 6 * f->rope_freq,
                                MDT_ROPE_HALF, qkv[j] + bb * H * S * D, S, 0); // [H/T, S, D]
    }
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t bb = 0; bb < B; bb++)
        MDT_TRY(mdt_attention(mesh, ar, qkv[0] + bb * H * S * D, qkv[1] + bb * H * S * D,
                              qkv[2] + bb * H * S * D, H, S, D, scale, ao + bb * S * Al,
                              Al));                           // [S, A/T]
    MDT_TRY(row_linear(A, &b->to_out, ao, Al, Al, y, B * S)); // [B*S, C]
    (void)C;
    mdt_arena_rewind(ar, mk);
    return MDT_OK;
}

/* SwiGLU FFN on rows n [B*S, C]: y [B*S, C] = net.2(value * SiLU(gate)), TP-sharded. */
static mdt_status ff_part(const h3 *f, const h3_act *A, const h3_block *b, const float *n,
                          int64_t M, float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(A->ar);
    const int64_t Fl = A->Fl;
    float *h2 = mdt_arena_floats(A->ar, M * 2 * Fl); // [M, 2F/T] = [value_k | gate_k]
    float *h1 = mdt_arena_floats(A->ar, M * Fl);     // [M, F/T]
    if (!h2 || !h1)
        return MDT_E_NOMEM;
    (void)f;
    linear(&b->ff0, n, M, 2 * Fl, h2);
    mdt_k_swiglu(h2, h1, M, Fl);
    MDT_TRY(row_linear(A, &b->ff2, h1, Fl, Fl, y, M)); // [M, C]
    mdt_arena_rewind(A->ar, mk);
    return MDT_OK;
}

/* Token refiner on the full text x [B, Nt, C] (every rank; TP-sharded, plain attention). */
static mdt_status refiner(const h3 *f, h3_act *A, float *x, int64_t Nt) {
    const int64_t C = f->hidden, M = A->B * Nt;
    const int64_t saved = A->B;
    mdt_arena_mark mk = mdt_arena_mark_get(A->ar);
    float *n = mdt_arena_floats(A->ar, M * C), *y = mdt_arena_floats(A->ar, M * C);
    if (!n || !y)
        return MDT_E_NOMEM;
    for (int64_t i = 0; i < f->refiner_layers; i++) {
        const h3_block *b = &f->ref[i];
        mdt_k_rmsnorm(x, b->norm1, n, M, C, (float)f->norm_eps);
        MDT_TRY(attn_part(f, A, b, n, Nt, NULL, NULL, NULL, y));
        mdt_k_add(x, y, M * C);
        mdt_k_rmsnorm(x, b->norm2, n, M, C, (float)f->norm_eps);
        MDT_TRY(ff_part(f, A, b, n, M, y));
        mdt_k_add(x, y, M * C);
    }
    mdt_k_rmsnorm(x, f->final_norm, n, M, C, (float)f->final_eps);
    mdt_k_copy2d(x, 0, n, 0, 1, M * C);
    A->B = saved;
    mdt_arena_rewind(A->ar, mk);
    return MDT_OK;
}

/* Row maps of the rows of one modality that land in this rank's chunk [s0, s0 + Sc): for every
 * batch element, source row b N + i and packed row b Sc + idx[i] - s0, uploaded to `ar`;
 * *n = how many. Host scratch from `ha`. */
static mdt_status chunk_rows(const h3_act *A, mdt_arena *ha, const int64_t *idx, int64_t N,
                             int64_t s0, int64_t **src_rows, int64_t **dst_rows, int64_t *n) {
    const int64_t B = A->B, Sc = A->Sc;
    int64_t *sr = (int64_t *)(void *)mdt_arena_floats(ha, 2 * B * N); // [B N] host
    int64_t *dr = (int64_t *)(void *)mdt_arena_floats(ha, 2 * B * N); // [B N] host
    if (!sr || !dr)
        return MDT_E_NOMEM;
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < N; i++)
            if (idx[i] >= s0 && idx[i] < s0 + Sc)
                sr[k] = b * N + i, dr[k] = b * Sc + idx[i] - s0, k++;
    *src_rows = sr, *dst_rows = mdt_k_upload(A->ar, dr, sizeof(int64_t) * (size_t)(k ? k : 1));
    *n = k;
    return *dst_rows ? MDT_OK : MDT_E_NOMEM;
}

/* Projects the rows of one modality that land in this rank's chunk [s0, s0 + Sc) and scatters
 * them into h [B, Sc, C]: src [B, N, in] (host input), idx [N] packed positions. */
static mdt_status scatter_modality(const h3_act *A, mdt_arena *ha, const mdt_lin *l,
                                   const float *src, int64_t N, const int64_t *idx, int64_t s0,
                                   float *h) {
    const int64_t in = l->in, C = l->out;
    mdt_arena_mark mk = mdt_arena_mark_get(A->ar);
    int64_t *sr, *dr, k;
    MDT_TRY(chunk_rows(A, ha, idx, N, s0, &sr, &dr, &k));
    float *xin_h = mdt_arena_floats(ha, k * in); // [k, in] host
    if (!xin_h)
        return MDT_E_NOMEM;
    mdt_cpu_copy_rows(xin_h, in, NULL, src, in, sr, k, in);
    const float *xin = mdt_k_upload(A->ar, xin_h, sizeof(float) * (size_t)(k * in)); // [k, in]
    float *y = mdt_arena_floats(A->ar, k * C);                                       // [k, C]
    if (!xin || !y)
        return MDT_E_NOMEM;
    linear(l, xin, k, C, y);                     // [k, C]
    mdt_k_copy_rows(h, C, dr, y, C, NULL, k, C); // rows of h [B, Sc, C]
    mdt_arena_rewind(A->ar, mk);
    return MDT_OK;
}

/* Head outputs: local [B, Sc, O] -> full [B, S, O] over the CP group (chunk order), then the
 * rows of `idx` into out [B, N, O] (host). */
static mdt_status gather_select(const h3_act *A, mdt_arena *ha, int P, const float *loc, int64_t S,
                                int64_t O, const int64_t *idx, int64_t N, float *out) {
    const int64_t B = A->B;
    mdt_arena_mark mk = mdt_arena_mark_get(A->ar);
    float *full = mdt_arena_floats(A->ar, B * S * O);                   // [B, S, O]
    float *sel = mdt_arena_floats(A->ar, B * N * O);                    // [B, N, O]
    int64_t *rows = (int64_t *)(void *)mdt_arena_floats(ha, 2 * B * N); // [B N] host
    if (!full || !sel || !rows)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_cp_gather_rows(A->cp, A->ar, P, B, S, O, loc, full));
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < N; i++)
            rows[b * N + i] = b * S + idx[i];
    const int64_t *drows =
        mdt_k_upload(A->ar, rows, sizeof(int64_t) * (size_t)(B * N > 0 ? B * N : 1));
    if (!drows)
        return MDT_E_NOMEM;
    mdt_k_copy_rows(sel, O, NULL, full, O, drows, B * N, O); // [B N, O]
    mdt_k_to_host(out, sel, sizeof(float) * (size_t)(B * N * O));
    mdt_arena_rewind(A->ar, mk);
    return MDT_OK;
}

static mdt_status h3_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const h3 *f = m->impl;
    mdt_arena *ar = &m->arena, *ha = &m->harena; /* activations; host inputs and tables */
    mdt_mesh *mesh = m->mesh;
    const int64_t C = f->hidden, E = f->time_embed, Fr = f->rope_freq;
    h3_act A = {0};
    A.T = m->T, A.k = m->tp_index, A.mesh = mesh, A.ar = ar;
    A.Hl = f->heads / m->T, A.Al = f->A / m->T, A.Fl = f->ffn / m->T;
    int P, chunk;
    mdt_model_cp_split(m, &P, &chunk);
    A.cp = P > 1 ? mesh : NULL;

    const int64_t B = mdt_input_dim(in, "hidden_states", 0);
    const int64_t Nv = mdt_input_dim(in, "hidden_states", 1);
    const int64_t Na = mdt_input_dim(in, "audio_hidden_states", 1);
    const int64_t Nt = mdt_input_dim(in, "encoder_hidden_states", 1);
    const int64_t S = mdt_input_dim(in, "position_ids", 0);
    const int64_t Tn = mdt_input_dim(in, "timestep", 0);
    if (B < 1 || Nv < 0 || Na < 0 || Nt < 0 || S < 1 || Tn < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: MiniMax-H3 needs hidden_states [B, N_video, %lld], "
                        "audio_hidden_states [B, N_audio, %lld], encoder_hidden_states [B, N_text, "
                        "%lld], timestep [T_n], position_ids [S, 3] and the index tensors",
                        (long long)f->Pv, (long long)f->audio_in, (long long)f->text_dim);
    const float *hs, *ahs, *ehs;
    float *ts, *pos;
    int64_t *tidx, *tags, *vidx, *aidx, *xidx;
    MDT_TRY(mdt_input_f32_view(in, "hidden_states", 3, (int64_t[]){B, Nv, f->Pv}, ha, &hs));
    MDT_TRY(mdt_input_f32_view(in, "audio_hidden_states", 3, (int64_t[]){B, Na, f->audio_in}, ha,
                               &ahs));
    MDT_TRY(mdt_input_f32_view(in, "encoder_hidden_states", 3, (int64_t[]){B, Nt, f->text_dim}, ha,
                               &ehs));
    MDT_TRY(mdt_input_f32(in, "timestep", 1, (int64_t[]){Tn}, ha, &ts));
    MDT_TRY(mdt_input_f32(in, "position_ids", 2, (int64_t[]){S, 3}, ha, &pos));
    MDT_TRY(mdt_input_i64(in, "timestep_indices", 1, (int64_t[]){S}, 0, Tn, ha, &tidx));
    MDT_TRY(mdt_input_i64(in, "token_tags", 1, (int64_t[]){S}, 0, H3_MOD, ha, &tags));
    MDT_TRY(mdt_input_i64(in, "video_indices", 1, (int64_t[]){Nv}, 0, S, ha, &vidx));
    MDT_TRY(mdt_input_i64(in, "audio_indices", 1, (int64_t[]){Na}, 0, S, ha, &aidx));
    MDT_TRY(mdt_input_i64(in, "text_indices", 1, (int64_t[]){Nt}, 0, S, ha, &xidx));
    int64_t s0, Sc;
    mdt_split_range(S, P, chunk, &s0, &Sc);
    A.B = B, A.Sc = Sc, A.Tn = Tn;

    /* rotary tables for the local rows: angles (t, h, w) x inv_freq (float math), the three
     * axes' columns concatenated, then the whole repeated: column c uses axis (c mod 3F) / F and
     * frequency inv_freq[c mod F] */
    const int64_t rot = 6 * Fr;
    int32_t *col_axis = (int32_t *)(void *)mdt_arena_floats(ha, rot);   // [6F] host
    double *col_freq = (double *)(void *)mdt_arena_floats(ha, 2 * rot); // [6F] host
    float *inv = mdt_arena_floats(ha, Fr);
    /* timestep embedding: [cos, sin] of t * exp(-ln(1e4) i / (freq/2)), unscaled t */
    const int64_t half = f->freq_dim / 2;
    float *e_h = mdt_arena_floats(ha, Tn * f->freq_dim);               // [T_n, freq] host
    int64_t *aidx_h = (int64_t *)(void *)mdt_arena_floats(ha, 2 * Sc); // [S/P] AdaLN rows
    int64_t *tidx_h = (int64_t *)(void *)mdt_arena_floats(ha, 2 * Sc); // [S/P] norm_out rows
    if (!col_axis || !col_freq || !inv || !e_h || !aidx_h || !tidx_h)
        return MDT_E_NOMEM;
    for (int64_t j = 0; j < Fr; j++) /* non-persistent buffer: computed on every rank */
        inv[j] = 1.0f / powf((float)f->rope_theta, (float)(2 * j) / (float)(2 * Fr));
    for (int64_t c = 0; c < rot; c++)
        col_axis[c] = (int32_t)((c % (3 * Fr)) / Fr), col_freq[c] = (double)inv[c % Fr];
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t i = 0; i < half; i++) {
            const float fr = expf(-logf(10000.0f) * (float)i / (float)half);
            e_h[t * f->freq_dim + i] = cosf(ts[t] * fr);
            e_h[t * f->freq_dim + half + i] = sinf(ts[t] * fr);
        }
    for (int64_t s = 0; s < Sc; s++)
        aidx_h[s] = tidx[s0 + s] * H3_MOD + tags[s0 + s], tidx_h[s] = tidx[s0 + s];
    int64_t *xsr, *xdr, nx;
    MDT_TRY(chunk_rows(&A, ha, xidx, Nt, s0, &xsr, &xdr, &nx)); /* text rows of my chunk */

    /* to the backend's memory (the same pointers on the CPU backend) */
    const float *pos_d = mdt_k_upload(ar, pos + s0 * 3, sizeof(float) * (size_t)(Sc * 3));
    const int32_t *cax_d = mdt_k_upload(ar, col_axis, sizeof(int32_t) * (size_t)rot);
    const double *cfr_d = mdt_k_upload(ar, col_freq, sizeof(double) * (size_t)rot);
    float *cos_t = mdt_arena_floats(ar, Sc * rot), *sin_t = mdt_arena_floats(ar, Sc * rot);
    const float *e = mdt_k_upload(ar, e_h, sizeof(float) * (size_t)(Tn * f->freq_dim));
    const int64_t *aidx_l = mdt_k_upload(ar, aidx_h, sizeof(int64_t) * (size_t)(Sc ? Sc : 1));
    const int64_t *tidx_l = mdt_k_upload(ar, tidx_h, sizeof(int64_t) * (size_t)(Sc ? Sc : 1));
    const float *ehs_d = mdt_k_upload(ar, ehs, sizeof(float) * (size_t)(B * Nt * f->text_dim));
    float *th = mdt_arena_floats(ar, Tn * f->time_hidden); // [T_n, time_hidden]
    float *temb = mdt_arena_floats(ar, Tn * E);            // [T_n, E]
    float *h = mdt_arena_floats(ar, B * Sc * C);           // [B, S/P, C] packed local rows
    float *txt = mdt_arena_floats(ar, B * Nt * C);         // [B, N_text, C]
    if (!pos_d || !cax_d || !cfr_d || !cos_t || !sin_t || !e || !aidx_l || !tidx_l || !ehs_d ||
        !th || !temb || !h || !txt)
        return MDT_E_NOMEM;
    mdt_k_angle_table(pos_d, 3, Sc, rot, cax_d, cfr_d, 0, cos_t, sin_t); // [S/P, 6F]
    linear(&f->t_lin1, e, Tn, f->time_hidden, th);
    mdt_k_silu(th, Tn * f->time_hidden);
    linear(&f->t_lin2, th, Tn, E, temb);
    mdt_k_silu(temb, Tn * E); // SiLU(temb): the input of every AdaLN projection
    A.silu_temb = temb;
    MDT_TRY(mdt_guard_finite(mesh, "time_embedder", temb, Tn * E));

    /* packed sequence: text (refined, full on every rank), video and audio rows of my chunk */
    mdt_k_fill(h, B * Sc * C, 0.0f);
    linear(&f->ctx_emb, ehs_d, B * Nt, C, txt); // [B, N_text, C]
    MDT_TRY(refiner(f, &A, txt, Nt));
    MDT_TRY(mdt_guard_finite(mesh, "token_refiner", txt, B * Nt * C));
    const int64_t *xsr_d = mdt_k_upload(ar, xsr, sizeof(int64_t) * (size_t)(nx ? nx : 1));
    if (!xsr_d)
        return MDT_E_NOMEM;
    mdt_k_copy_rows(h, C, xdr, txt, C, xsr_d, nx, C); // text rows into h [B, S/P, C]
    MDT_TRY(scatter_modality(&A, ha, &f->proj_in, hs, Nv, vidx, s0, h));
    MDT_TRY(scatter_modality(&A, ha, &f->audio_proj_in, ahs, Na, aidx, s0, h));
    MDT_TRY(mdt_guard_finite(mesh, "proj_in / audio_proj_in", h, B * Sc * C));

    float *mod = mdt_arena_floats(ar, Tn * 18 * C); // [T_n, 18C] = [3 T_n, 6C]
    float *n = mdt_arena_floats(ar, B * Sc * C);    // [B, S/P, C]
    float *y = mdt_arena_floats(ar, B * Sc * C);    // [B, S/P, C]
    if (!mod || !n || !y)
        return MDT_E_NOMEM;
    const int64_t M = B * Sc;
    for (int64_t i = 0; i < f->layers; i++) {
        const h3_block *b = &f->blk[i];
        MDT_TRY(adaln(f, &A, &b->adaln, mod)); // [T_n, 18C]
        for (int64_t bb = 0; bb < B; bb++) {
            mdt_k_rmsnorm(h + bb * Sc * C, b->norm1, n + bb * Sc * C, Sc, C, (float)f->norm_eps);
            mdt_k_modulate_rows(n + bb * Sc * C, Sc, C, mod, 6 * C, aidx_l, 0, C);
        }
        MDT_TRY(attn_part(f, &A, b, n, Sc, cos_t, sin_t, A.cp, y)); // [B*S/P, C]
        for (int64_t bb = 0; bb < B; bb++)
            mdt_k_gate_residual_rows(h + bb * Sc * C, y + bb * Sc * C, C, mod, 6 * C, aidx_l, 2 * C,
                                     Sc, C);
        for (int64_t bb = 0; bb < B; bb++) {
            mdt_k_rmsnorm(h + bb * Sc * C, b->norm2, n + bb * Sc * C, Sc, C, (float)f->norm_eps);
            mdt_k_modulate_rows(n + bb * Sc * C, Sc, C, mod, 6 * C, aidx_l, 3 * C, 4 * C);
        }
        if (i == 0)
            MDT_TRY(mdt_test_fail_point(mesh, "step")); /* test-only: fail mid-step */
        MDT_TRY(ff_part(f, &A, b, n, M, y));            // [B*S/P, C]
        for (int64_t bb = 0; bb < B; bb++)
            mdt_k_gate_residual_rows(h + bb * Sc * C, y + bb * Sc * C, C, mod, 6 * C, aidx_l, 5 * C,
                                     Sc, C);
        char stage[48];
        snprintf(stage, sizeof stage, "transformer_blocks.%lld", (long long)i);
        MDT_TRY(mdt_guard_finite(mesh, stage, h, B * Sc * C));
    }
    /* norm_out: [shift | scale] per timestep, rows picked by timestep index */
    MDT_TRY(adaln(f, &A, &f->norm_out, mod)); // [T_n, 2C]
    for (int64_t bb = 0; bb < B; bb++) {
        mdt_k_rmsnorm(h + bb * Sc * C, f->norm_out_w, n + bb * Sc * C, Sc, C, (float)f->final_eps);
        mdt_k_modulate_rows(n + bb * Sc * C, Sc, C, mod, 2 * C, tidx_l, 0, C);
    }
    float *vo = mdt_arena_floats(ar, M * f->Pv), *ao = mdt_arena_floats(ar, M * f->audio_in);
    mdt_tensor *ov, *oa;
    if (!vo || !ao)
        return MDT_E_NOMEM;
    linear(&f->proj_out, n, M, f->Pv, vo);             // [B, S/P, Pv]
    linear(&f->audio_proj_out, n, M, f->audio_in, ao); // [B, S/P, audio]
    MDT_TRY(mdt_guard_finite(mesh, "proj_out", vo, M * f->Pv));
    MDT_TRY(mdt_guard_finite(mesh, "audio_proj_out", ao, M * f->audio_in));
    MDT_TRY(mdt_tensor_set_add(out, "sample", MDT_F32, 3, (int64_t[]){B, Nv, f->Pv}, &ov));
    MDT_TRY(
        mdt_tensor_set_add(out, "audio_sample", MDT_F32, 3, (int64_t[]){B, Na, f->audio_in}, &oa));
    MDT_TRY(gather_select(&A, ha, P, vo, S, f->Pv, vidx, Nv, ov->data));
    MDT_TRY(gather_select(&A, ha, P, ao, S, f->audio_in, aidx, Na, oa->data));

    /* no silent degrade */
    const int R = mesh ? mesh->R : 1, U = mesh ? mesh->U : 1;
    const int r = mesh ? mesh->r : 0, u = mesh ? mesh->u : 0;
    int64_t h0, hn, L = 0, q0, nq;
    mdt_split_range(A.Hl, U, u, &h0, &hn);
    for (int j = 0; j < U; j++) /* the layout's promise, whatever the forward did */
        mdt_split_range(S, R * U, r * U + j, &q0, &nq), L += nq;
    const int64_t calls = f->layers * B, rq = f->refiner_layers * B * A.Hl * Nt;
    mdt_promise p = {.want_q = calls * hn * L + rq,
                     .want_kv = calls * hn * S + rq,
                     .whole_q = calls * A.Hl * S + rq,
                     .unscattered_q = calls * A.Hl * L + rq,
                     .ringless_kv = calls * hn * L + rq,
                     .owes = {m->T > 1, R > 1 && hn > 0 && f->layers > 0, U > 1 && f->layers > 0,
                              R * U > 1 && Sc > 0}};
    return mdt_model_check_promise(m, &p);
}

/* ---- random inputs: one packed layout [text | audio | video] ---- */
static mdt_status h3_make_inputs(const void *impl, const mdt_inputs_params *p,
                                 mdt_tensor_set *out) {
    const h3 *f = impl;
    mdt_rng rng;
    mdt_tensor *t;
    const int64_t B = p->batch > 0 ? p->batch : 1;
    const int64_t Nv = p->img_tokens > 0 ? p->img_tokens : 8;
    const int64_t Nt = p->txt_tokens > 0 ? p->txt_tokens : 4;
    const int64_t Na = p->audio_tokens > 0 ? p->audio_tokens : 6;
    const int64_t S = Nt + Na + Nv;
    mdt_rng_seed(&rng, p->seed);
    const struct {
        const char *name;
        int64_t n, w;
    } lat[] = {{"hidden_states", Nv, f->Pv},
               {"audio_hidden_states", Na, f->audio_in},
               {"encoder_hidden_states", Nt, f->text_dim}};
    for (int i = 0; i < 3; i++) {
        MDT_TRY(mdt_tensor_set_add(out, lat[i].name, MDT_F32, 3, (int64_t[]){B, lat[i].n, lat[i].w},
                                   &t));
        for (int64_t j = 0; j < mdt_tensor_numel(t); j++)
            ((float *)t->data)[j] = (float)mdt_rng_normal(&rng);
    }
    MDT_TRY(mdt_tensor_set_add(out, "timestep", MDT_F32, 1, (int64_t[]){2}, &t));
    ((float *)t->data)[0] = (float)p->timestep;
    ((float *)t->data)[1] = (float)(p->timestep * 0.5);
    mdt_tensor *ti, *tg, *pos, *vi, *ai, *xi;
    MDT_TRY(mdt_tensor_set_add(out, "timestep_indices", MDT_I64, 1, (int64_t[]){S}, &ti));
    MDT_TRY(mdt_tensor_set_add(out, "token_tags", MDT_I64, 1, (int64_t[]){S}, &tg));
    MDT_TRY(mdt_tensor_set_add(out, "position_ids", MDT_I64, 2, (int64_t[]){S, 3}, &pos));
    MDT_TRY(mdt_tensor_set_add(out, "video_indices", MDT_I64, 1, (int64_t[]){Nv}, &vi));
    MDT_TRY(mdt_tensor_set_add(out, "audio_indices", MDT_I64, 1, (int64_t[]){Na}, &ai));
    MDT_TRY(mdt_tensor_set_add(out, "text_indices", MDT_I64, 1, (int64_t[]){Nt}, &xi));
    int64_t *tiv = ti->data, *tgv = tg->data, *pv = pos->data;
    const int64_t w = (int64_t)ceil(sqrt((double)Nv));
    for (int64_t s = 0; s < S; s++) {
        const int is_text = s < Nt, is_audio = !is_text && s < Nt + Na;
        tgv[s] = is_text ? 1 : is_audio ? 2 : 0;
        tiv[s] = is_audio ? 1 : 0;
        const int64_t v = s - Nt - Na;
        pv[s * 3] = is_text ? s : is_audio ? s - Nt : 0;
        pv[s * 3 + 1] = (!is_text && !is_audio) ? v / w : 0;
        pv[s * 3 + 2] = (!is_text && !is_audio) ? v % w : 0;
        if (is_text)
            ((int64_t *)xi->data)[s] = s;
        else if (is_audio)
            ((int64_t *)ai->data)[s - Nt] = s;
        else
            ((int64_t *)vi->data)[v] = s;
    }
    return MDT_OK;
}

static const char *h3_preset(const char *name) {
    if (strcmp(name, "tiny") == 0) /* diffusers' own test config */
        return "{\n  \"_class_name\": \"MiniMaxH3Transformer3DModel\",\n"
               "  \"num_attention_heads\": 2,\n  \"attention_head_dim\": 16,\n"
               "  \"hidden_size\": 24,\n  \"num_layers\": 2,\n  \"num_refiner_layers\": 2,\n"
               "  \"ffn_dim\": 32,\n  \"in_channels\": 4,\n  \"audio_in_channels\": 6,\n"
               "  \"patch_size\": [1, 2, 2],\n  \"text_dim\": 8,\n  \"freq_dim\": 8,\n"
               "  \"time_embed_hidden_dim\": 24,\n  \"time_embed_dim\": 16,\n"
               "  \"rope_freq_dim\": 2\n}\n";
    return NULL;
}

/* The packed sequence splits once it is built: these per-row inputs split with it (the rotary
 * rows come from position_ids; adaln rows from timestep_indices and token_tags). */
static const mdt_cp_plan k_h3_cp_plan = {
    .nsplit = 3,
    .split = {{"position_ids", 0}, {"timestep_indices", 0}, {"token_tags", 0}},
    .ngather = 2,
    .gather = {{"sample", 1}, {"audio_sample", 1}},
};

const mdt_family mdt_family_minimax_h3 = {
    .name = "minimax-h3",
    .class_name = "MiniMaxH3Transformer3DModel",
    .impl_size = sizeof(h3),
    .configure = h3_configure,
    .check_layout = h3_check_layout,
    .forward = h3_forward,
    .make_inputs = h3_make_inputs,
    .preset = h3_preset,
    .cp_plan = &k_h3_cp_plan,
    .latent_input = "hidden_states",
    .timestep_input = "timestep",
    .output = "sample",
};
