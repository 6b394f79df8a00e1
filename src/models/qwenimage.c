/*
 * qwenimage.c — diffusers' QwenImageTransformer2DModel (Qwen-Image, diffusers 0.42.1): config,
 * weight table with TP styles, CP plan, forward, random inputs. Semantics follow diffusers:
 * Timesteps(256, cos first, scale=1000): the angle is (t f) rounded, then x1000 (not t x1000
 * first, as Flux); TimestepEmbedding's SiLU MLP gives temb and every modulation reads SiLU(temb);
 * the text is RMSNorm'd (txt_norm, eps 1e-6, weight) then projected (txt_in), the latents by
 * img_in; every block is dual-stream: image and text each with their own modulation table
 * (img_mod.1 / txt_mod.1: [shift, scale, gate] x 2), LayerNorm eps 1e-6 without affine, their
 * own q/k/v with per-head RMSNorm (eps 1e-6), one joint attention over [text | image], their own
 * GELU(tanh) MLP; norm_out is AdaLayerNormContinuous (scale first), proj_out on the image rows.
 * RoPE (QwenEmbedRope, scale_rope=True): complex pairs (interleaved channels), per axis a of
 * width d the pair j turns at 1/1e4^(2j/d) (float32, angle = position x frequency in float32);
 * image i of img_shapes, a (F, H, W) grid, puts its row (f, y, x) at positions
 * (i + f, y - ceil(H/2), x - ceil(W/2)); text token j at top + j on all three axes, top =
 * max over images of max(H/2, W/2); diffusers' table holds 4096 positions per sign.
 *
 * Non-tensor arguments: `img_shapes` is int64 [B, n, 3] (or [B, 3] for n = 1): image i of
 * element b is (frames, height, width) in patches, images in sequence order; every element must
 * hold the same shapes (diffusers uses element 0's for all). The text mask masks keys only and
 * image keys are always attended, so a masked text token never reaches an image row (the only
 * output): the forward drops the masked text rows before the split, each kept row keeping its
 * RoPE position — the same result as diffusers' masked softmax, with less work. Elements whose
 * masks differ run one pass each. Refused: `guidance` (diffusers 0.42.1 fails with it),
 * `txt_seq_lens` (removed in 0.42.1); attention_kwargs carries only a LoRA scale in diffusers
 * (no tensor, nothing to encode). `controlnet_block_samples` [B, N, Si, C] (controlnet.h): residual
 * i / ceil(L / N) added to the image rows after block i.
 * Qwen-Image-Layered: use_additional_t_cond adds row `additional_t_cond[b]` (0 or 1; int [B], or
 * [1] or 0-d for the batch; required) of time_text_embed.addition_t_embedding [2, C] to element
 * b's temb (under zero_cond_t one value only, added to the t and 0 t rows: diffusers' broadcast);
 * use_layer3d_rope puts the last image of img_shapes (the pipeline's input image, one frame) at
 * frame position -1 and the text from max(top, n - 1) on.
 * zero_cond_t (Qwen-Image-Edit-2511): the timestep embedding of t and of 0 t; each element's
 * image rows past its first image (the condition images) are modulated by the 0 table in both
 * halves of every block (diffusers' modulate_index), the text stream and norm_out by the t one.
 *
 * TP: diffusers' _tp_plan (q/k/v and added q/k/v colwise, to_out.0 / to_add_out rowwise,
 * img_mlp / txt_mlp net.0.proj colwise, net.2 rowwise), plus img_mod.1, txt_mod.1 and
 * norm_out.linear and txt_in as replicated-input rowwise (diffusers keeps them replicated);
 * img_in, txt_norm and proj_out replicated. CP: diffusers' _cp_plan: hidden_states and (the kept
 * rows of) encoder_hidden_states split on dim 1 into P chunks each, the rotary rows with them (each
 * rank builds its own), ControlNet residuals on dim 2 with the image rows; the joint sequence of a
 * rank is its text chunk then its image chunk; `sample` gathered on dim 1 after proj_out.
 */
#include "models/cache.h"
#include "models/controlnet.h"
#include "models/joint.h"

#include "backend/backend.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

enum { QWEN_MAX_LAYERS = 128, QWEN_ROPE_POS = 4096 };
static const float k_eps = 1e-6f;

typedef struct qwen_block {
    mdt_lin img_mod, txt_mod, img_ff0, img_ff2, txt_ff0, txt_ff2;
    mdt_joint_attn attn; /* the image and text streams' q/k/v, norms and outputs */
} qwen_block;

typedef struct qwen {
    int64_t patch, in_ch, out_ch, layers, head_dim, heads, joint_dim, axes[3];
    int zero_cond_t; /* Qwen-Image-Edit-2511: condition images modulated at timestep 0 */
    int add_t_cond;  /* Qwen-Image-Layered: temb + addition_t_embedding[additional_t_cond] */
    int layer3d;     /* Qwen-Image-Layered: the last image at frame position -1 */
    int64_t inner, mlp_hidden;
    mdt_lin t_lin1, t_lin2, img_in, txt_in, norm_out, proj_out;
    const float *txt_norm;
    const float *add_t; /* [2, C] addition_t_embedding (add_t_cond) */
    qwen_block blk[QWEN_MAX_LAYERS];
} qwen;

static const mdt_cp_plan k_qwen_cp_plan = {
    .nsplit = 3,
    .split = {{"hidden_states", 1, NULL},
              {"encoder_hidden_states", 1, NULL},
              {"controlnet_block_samples", 2, NULL}},
    .ngather = 1,
    .gather = {{"sample", 1, NULL}},
};

/* ---- weight table (every Qwen-Image linear has a bias) ---- */

static mdt_status qwen_table(qwen *f, mdt_wtable *t) {
    const int64_t C = f->inner, M = f->mlp_hidden, D = f->head_dim;
    const mdt_tp_style rep = MDT_TP_REPLICATED;
    const char *te = "time_text_embed.timestep_embedder.";
    char p[MDT_NAME_MAX];
    mdt_wtable_rows(t, MDT_ROWS_ONE); /* conditioning: one row per sample */
    MDT_TRY(mdt_wtable_add_linear(t, &f->t_lin1, te, "linear_1", C, 256, rep, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->t_lin2, te, "linear_2", C, C, rep, 1));
    MDT_TRY(mdt_wtable_add_vector(t, &f->txt_norm, "", "txt_norm.weight", f->joint_dim));
    if (f->add_t_cond) /* an nn.Embedding(2, C): rows read whole, replicated */
        MDT_TRY(mdt_wtable_add(t, "time_text_embed.addition_t_embedding.weight", 2, 2, C, rep,
                               &f->add_t));
    mdt_wtable_rows(t, MDT_ROWS_ALL);
    MDT_TRY(mdt_wtable_add_linear(t, &f->img_in, "", "img_in", C, f->in_ch, rep, 1));
    MDT_TRY(mdt_dit_declare_text_embedder(t, &f->txt_in, "txt_in", C, f->joint_dim, 1));
    for (int64_t i = 0; i < f->layers; i++) {
        qwen_block *b = &f->blk[i];
        snprintf(p, sizeof p, "transformer_blocks.%lld.", (long long)i);
        MDT_TRY(mdt_dit_declare_adaln(t, &b->img_mod, p, "img_mod.1", 6 * C, C, 1));
        MDT_TRY(mdt_dit_declare_adaln(t, &b->txt_mod, p, "txt_mod.1", 6 * C, C, 1));
        MDT_TRY(mdt_joint_declare_attention(t, p, &b->attn, C, 1));
        MDT_TRY(mdt_joint_declare_qk_norms(t, p, &b->attn, D, k_eps));
        mdt_wtable_rows(t, MDT_ROWS_IMAGE);
        MDT_TRY(mdt_dit_declare_ff(t, p, "img_mlp", &b->img_ff0, &b->img_ff2, C, M, 0, 1));
        mdt_wtable_rows(t, MDT_ROWS_TEXT);
        MDT_TRY(mdt_dit_declare_ff(t, p, "txt_mlp", &b->txt_ff0, &b->txt_ff2, C, M, 0, 1));
    }
    return mdt_joint_declare_out(t, &f->norm_out, &f->proj_out, C, f->patch * f->patch * f->out_ch,
                                 1);
}

static void qwen_dims(const void *impl, mdt_model_dims *d) {
    const qwen *f = impl;
    *d = (mdt_model_dims){.heads = f->heads,
                          .head_dim = f->head_dim,
                          .hidden = f->inner,
                          .ffn = f->mlp_hidden,
                          .self_attn = f->layers,
                          .out = f->patch * f->patch * f->out_ch};
}

static mdt_status qwen_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    qwen *f = impl;
    int nax = 4;
    int64_t *const ints[] = {&f->patch,    &f->in_ch, &f->layers,
                             &f->head_dim, &f->heads, &f->joint_dim};
    MDT_TRY(mdt_cfg_ints(cfg,
                         "patch_size=2 in_channels=64 num_layers=60 attention_head_dim=128 "
                         "num_attention_heads=24 joint_attention_dim=3584",
                         ints, 6));
    /* out_channels: absent -> 16 (the signature's default); null or 0 -> in_channels */
    const int oc_given = cJSON_GetObjectItemCaseSensitive(cfg, "out_channels") != NULL;
    MDT_TRY(mdt_cfg_int(cfg, "out_channels", 0, oc_given ? 0 : 16, &f->out_ch));
    if (f->out_ch == 0)
        f->out_ch = f->in_ch;
    MDT_TRY(mdt_cfg_bool(cfg, "zero_cond_t", 0, &f->zero_cond_t));
    MDT_TRY(mdt_cfg_bool(cfg, "use_additional_t_cond", 0, &f->add_t_cond));
    MDT_TRY(mdt_cfg_bool(cfg, "use_layer3d_rope", 0, &f->layer3d));
    MDT_TRY(mdt_cfg_int_array(cfg, "axes_dims_rope", f->axes, &nax));
    if (nax == 0)
        f->axes[0] = 16, f->axes[1] = 56, f->axes[2] = 56, nax = 3;
    if (nax != 3)
        return MDT_FAIL(MDT_E_INVALID, "config.json: axes_dims_rope must hold 3 values, not %d",
                        nax);
    if (f->patch < 1 || f->in_ch < 1 || f->out_ch < 1 || f->layers < 0 || f->head_dim < 2 ||
        f->heads < 1 || f->joint_dim < 1)
        return MDT_FAIL(MDT_E_INVALID, "config.json: Qwen-Image sizes must be positive");
    const int64_t dims[] = {f->patch, f->in_ch, f->out_ch, f->head_dim, f->heads, f->joint_dim};
    MDT_TRY(mdt_cfg_check_dims("Qwen-Image", dims, sizeof dims / sizeof dims[0]));
    if (f->patch * f->patch * f->out_ch > MDT_MAX_DIM || 4 * f->heads * f->head_dim > MDT_MAX_DIM)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: Qwen-Image widths exceed %lld",
                        (long long)MDT_MAX_DIM);
    if (f->layers > QWEN_MAX_LAYERS)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most %d transformer blocks",
                        QWEN_MAX_LAYERS);
    MDT_TRY(mdt_dit_check_rope_axes(f->axes, 3, f->head_dim));
    f->inner = f->heads * f->head_dim;
    f->mlp_hidden = 4 * f->inner;
    return qwen_table(f, t);
}

/* QwenImageTransformer2DModel.forward's tensors (img_shapes as int64 [B, n, 3] or [B, 3]);
 * additional_t_cond only where the config uses it (diffusers ignores it otherwise) */
#define QWEN_INPUTS                                                                                \
    {"hidden_states", MDT_IN_BATCH}, {"encoder_hidden_states", MDT_IN_BATCH | MDT_IN_BRANCH},      \
        {"encoder_hidden_states_mask", MDT_IN_BATCH | MDT_IN_BRANCH | MDT_IN_OPTIONAL},            \
        {"controlnet_block_samples", MDT_IN_BATCH | MDT_IN_SHARED | MDT_IN_OPTIONAL},              \
        {"timestep", MDT_IN_BATCH | MDT_IN_SHARED}, {                                              \
        "img_shapes", MDT_IN_BATCH                                                                 \
    }
static const mdt_input_decl *qwen_inputs(const void *impl) {
    static const mdt_input_decl k[] = {QWEN_INPUTS, {NULL, 0}};
    static const mdt_input_decl k_layered[] = {
        QWEN_INPUTS, {"additional_t_cond", MDT_IN_BATCH | MDT_IN_SHARED}, {NULL, 0}};
    return ((const qwen *)impl)->add_t_cond ? k_layered : k;
}

static mdt_status qwen_check_layout(const void *impl, int T, int R, int U) {
    (void)R, (void)U;
    return mdt_dit_check_heads(((const qwen *)impl)->heads, T);
}

/* ---- forward ---- */

/* A forward's inputs, read and checked (host memory but e256). */
typedef struct qwen_in {
    int64_t B, Si, St;     /* batch, image rows, text rows */
    const float *hs, *ehs; /* [B, Si, in], [B, St, joint] */
    const uint8_t *mask;   /* [B, St]: 1 = attended text token; NULL = no mask */
    float *img_pos;        /* [Si, 3]: (frame, row, column) rotary positions */
    int64_t txt_pos0;      /* text token j sits at txt_pos0 + j on every axis */
    int64_t n0;            /* rows of an element's first image (img_shapes[b][0]) */
    const float *e256;     /* [B, 256] timestep sinusoids, then (zero_cond_t) [B, 256] of 0 */
    const int64_t *add_t;  /* [B] additional_t_cond (use_additional_t_cond), else NULL */
    const float *ctl;      /* host [B or 1, N, Si, C] ControlNet residuals, or NULL */
    int64_t ctl_n;         /* their N */
    int ctl_shared;        /* one element's residuals for the batch (controlnet.h) */
} qwen_in;

/* e [n, 256] = [cos, sin] of ((t f_i) x 1000), f_i = exp(-ln(1e4) i / 128) in float32 math:
 * diffusers' Timesteps(256, flip_sin_to_cos, shift 0, scale=1000). */
static void timestep_embed(const float *t, int64_t n, float *e) {
    for (int64_t b = 0; b < n; b++)
        for (int64_t i = 0; i < 128; i++) {
            const float fr = expf(-logf(10000.0f) * (float)i / 128.0f), a = t[b] * fr;
            e[b * 256 + i] = cosf(a * 1000.0f);
            e[b * 256 + 128 + i] = sinf(a * 1000.0f);
        }
}

/* encoder_hidden_states_mask [B, St] (optional): BOOL, or numbers that are 0 or 1. */
static mdt_status read_mask(const mdt_tensor_set *in, qwen_in *x, mdt_arena *ha) {
    const char *name = "encoder_hidden_states_mask";
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    const int64_t n = x->B * x->St;
    uint8_t *mk = t ? (uint8_t *)(void *)mdt_arena_floats(ha, n / 4 + 1) : NULL; // [B, St] host
    float *v;
    x->mask = mk;
    if (!t)
        return MDT_OK;
    if (!mk)
        return MDT_E_NOMEM;
    if (t->dtype == MDT_BOOL && t->ndim == 2 && t->shape[0] == x->B && t->shape[1] == x->St) {
        for (int64_t i = 0; i < n; i++)
            mk[i] = ((const uint8_t *)t->data)[i] != 0;
        return MDT_OK;
    }
    MDT_TRY(mdt_input_f32(in, name, 2, (int64_t[]){x->B, x->St}, ha, &v));
    for (int64_t i = 0; i < n; i++) {
        if (v[i] != 0.0f && v[i] != 1.0f)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: tensor '%s' element %lld is %g; a mask holds 1 (attended "
                            "text token) or 0 (padding)",
                            name, (long long)i, (double)v[i]);
        mk[i] = v[i] != 0.0f;
    }
    return MDT_OK;
}

/* img_shapes int64 [B, n, 3] or [B, 3]: every element's images (frames, height, width), equal
 * across the batch, covering exactly the Si image rows; the rotary positions of each row (image
 * i's frames from i on; under use_layer3d_rope the last image, one frame, at frame -1). */
static mdt_status read_img_shapes(const qwen *f, const mdt_tensor_set *in, qwen_in *x,
                                  mdt_arena *ha) {
    const char *name = "img_shapes";
    const int is3 = mdt_input_dim(in, name, 2) >= 0;
    const int64_t n = is3 ? mdt_input_dim(in, name, 1) : 1, B = x->B;
    int64_t *v, rows = 0, top = 0;
    MDT_TRY(mdt_input_i64(in, name, is3 ? 3 : 2, is3 ? (int64_t[]){B, n, 3} : (int64_t[]){B, 3}, 1,
                          MDT_MAX_DIM, ha, &v));
    for (int64_t b = 1; b < B; b++)
        if (memcmp(v, v + b * n * 3, sizeof(int64_t) * (size_t)(n * 3)) != 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: '%s' of batch element %lld differs from element 0's "
                            "(diffusers builds the rotary table from element 0's alone); run "
                            "different shapes as separate batches",
                            name, (long long)b);
    for (int64_t i = 0; i < n; i++) {
        const int64_t F = v[3 * i], H = v[3 * i + 1], W = v[3 * i + 2];
        if (f->layer3d && i == n - 1 && F != 1)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: '%s' image %lld (the condition image of use_layer3d_rope, "
                            "the last) has %lld frames; diffusers' QwenEmbedLayer3DRope places "
                            "one frame there",
                            name, (long long)i, (long long)F);
        if (i + F > QWEN_ROPE_POS || H > 2 * QWEN_ROPE_POS || W > 2 * QWEN_ROPE_POS)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: '%s' image %lld is (%lld, %lld, %lld): diffusers' rotary "
                            "table allows image index + frames <= %d and height, width <= %d",
                            name, (long long)i, (long long)F, (long long)H, (long long)W,
                            QWEN_ROPE_POS, 2 * QWEN_ROPE_POS);
        rows += F * H * W;
        top = H / 2 > top ? H / 2 : top;
        top = W / 2 > top ? W / 2 : top;
    }
    if (f->layer3d && n - 1 > top) /* diffusers: max(max_vid_index, layer_num) */
        top = n - 1;
    if (rows != x->Si)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s' covers %lld image rows (frames x height x width summed) but "
                        "'hidden_states' has %lld",
                        name, (long long)rows, (long long)x->Si);
    if (top + x->St > QWEN_ROPE_POS)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: %lld text tokens from rotary position %lld exceed diffusers' "
                        "table of %d positions",
                        (long long)x->St, (long long)top, QWEN_ROPE_POS);
    x->txt_pos0 = top;
    x->n0 = v[0] * v[1] * v[2];
    float *pos = x->img_pos = mdt_arena_floats(ha, 3 * x->Si); // [Si, 3] host
    if (!pos)
        return MDT_E_NOMEM;
    for (int64_t i = 0; i < n; i++) {
        const int64_t F = v[3 * i], H = v[3 * i + 1], W = v[3 * i + 2];
        for (int64_t s = 0; s < F * H * W; s++, pos += 3) { /* (frame, row, col) of row s */
            const int64_t fr = f->layer3d && i == n - 1 ? -1 : i + s / (H * W),
                          y = s / W % H - (H - H / 2), xc = s % W - (W - W / 2);
            pos[0] = (float)fr, pos[1] = (float)y, pos[2] = (float)xc;
        }
    }
    return MDT_OK;
}

/* additional_t_cond, int [B], [1] or [] of 0 / 1 (nn.Embedding(2, C)'s rows): element b's row
 * (one value: every element's, as diffusers broadcasts it). */
static mdt_status read_add_t_cond(const qwen *f, const mdt_tensor_set *in, qwen_in *x,
                                  mdt_arena *ha) {
    const char *name = "additional_t_cond";
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    const int scalar = t && t->ndim == 0;
    const int64_t n = scalar ? 1 : mdt_input_dim(in, name, 0);
    int64_t *v;
    MDT_TRY(mdt_input_i64(in, name, scalar ? 0 : 1, (int64_t[]){n == 1 ? 1 : x->B}, 0, 2, ha, &v));
    if (f->zero_cond_t && n != 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s' holds %lld values, one per element, with zero_cond_t: "
                        "diffusers adds it to the 2 x %lld rows of the t and 0 embeddings and "
                        "fails; give one value for the batch ([1])",
                        name, (long long)n, (long long)x->B);
    int64_t *r = (int64_t *)(void *)mdt_arena_floats(ha, 2 * x->B); // [B] host
    if (!r)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < x->B; b++)
        r[b] = v[n == 1 ? 0 : b];
    x->add_t = r;
    return MDT_OK;
}

static mdt_status qwen_read(const qwen *f, mdt_dit *d, const mdt_tensor_set *in, qwen_in *x) {
    mdt_joint_in s; /* whole: each pass of qwen_run cuts its own batch elements */
    float *ts;
    MDT_TRY(mdt_joint_read_streams(d, in, f->in_ch, f->joint_dim, 0, &s));
    const int64_t B = s.B;
    *x = (qwen_in){.B = B, .Si = s.Si, .St = s.St, .hs = s.hs, .ehs = s.ehs};
    MDT_TRY(mdt_input_f32_batch(in, "timestep", 1, (int64_t[]){B}, d->ha, &ts)); /* or [1] */
    MDT_TRY(read_mask(in, x, d->ha));
    MDT_TRY(read_img_shapes(f, in, x, d->ha));
    if (f->add_t_cond)
        MDT_TRY(read_add_t_cond(f, in, x, d->ha));
    MDT_TRY(mdt_controlnet_read(d, in, "controlnet_block_samples", x->Si, f->inner, &x->ctl,
                                &x->ctl_n, &x->ctl_shared));
    /* zero_cond_t: diffusers' timestep = cat(t, 0 t), the condition images' rows modulated by
     * the second half of the embedding */
    const int64_t Bc = f->zero_cond_t ? 2 * B : B;
    float *e256 = mdt_arena_floats(d->ha, Bc * 256); // [Bc, 256] host
    if (!e256)
        return MDT_E_NOMEM;
    timestep_embed(ts, B, e256);
    if (f->zero_cond_t) {
        float *t0 = mdt_arena_floats(d->ha, B); // [B] host: t x 0, as diffusers (NaN stays NaN)
        if (!t0)
            return MDT_E_NOMEM;
        for (int64_t b = 0; b < B; b++)
            t0[b] = ts[b] * 0.0f;
        timestep_embed(t0, B, e256 + B * 256);
    }
    x->e256 = mdt_k_upload(d->ar, e256, sizeof(float) * (size_t)(Bc * 256));
    return x->e256 ? MDT_OK : MDT_E_NOMEM;
}

/* Rotary tables [st + si, D] of a rank's joint rows (backend memory): text token keep[j] at
 * txt_pos0 + keep[j], then image rows s0i.. at their positions. */
static mdt_status rope_table(const qwen *f, const mdt_dit *d, const qwen_in *x, const int64_t *keep,
                             int64_t st, int64_t s0i, int64_t si, mdt_rope *r) {
    const int64_t D = f->head_dim, S = st + si;
    float *pos = mdt_arena_floats(d->ha, 3 * S);                    // [S, 3] host
    int32_t *cax = (int32_t *)(void *)mdt_arena_floats(d->ha, D);   // [D] host
    double *cfr = (double *)(void *)mdt_arena_floats(d->ha, 2 * D); // [D] host
    float *cos_t = mdt_arena_floats(d->ar, S * D), *sin_t = mdt_arena_floats(d->ar, S * D);
    if (!pos || !cax || !cfr || !cos_t || !sin_t)
        return MDT_E_NOMEM;
    for (int64_t j = 0; j < st; j++)
        pos[3 * j] = pos[3 * j + 1] = pos[3 * j + 2] = (float)(x->txt_pos0 + keep[j]);
    memcpy(pos + 3 * st, x->img_pos + 3 * s0i, sizeof(float) * (size_t)(3 * si));
    for (int64_t a = 0, c = 0; a < 3; a++) /* pair j of axis a: both channels, one frequency */
        for (int64_t j = 0; j < f->axes[a] / 2; j++, c += 2) {
            const float fr = 1.0f / powf(10000.0f, (float)(2 * j) / (float)f->axes[a]);
            cax[c] = cax[c + 1] = (int32_t)a;
            cfr[c] = cfr[c + 1] = (double)fr;
        }
    const float *pos_d = mdt_k_upload(d->ar, pos, sizeof(float) * (size_t)(3 * S));
    const int32_t *cax_d = mdt_k_upload(d->ar, cax, sizeof(int32_t) * (size_t)D);
    const double *cfr_d = mdt_k_upload(d->ar, cfr, sizeof(double) * (size_t)D);
    if (!pos_d || !cax_d || !cfr_d)
        return MDT_E_NOMEM;
    mdt_k()->angle_table(pos_d, 3, S, D, cax_d, cfr_d, 0, cos_t, sin_t); // [S, D] float32 angles
    *r = (mdt_rope){cos_t, sin_t, D, MDT_ROPE_INTERLEAVED};
    return MDT_OK;
}

/* zero_cond_t's second modulation: condi [2B, C] the conditioning of timestep t then of 0 per
 * element; this rank's image rows from `split` on are the condition images'. */
typedef struct qwen_zero {
    const float *condi;
    int64_t split;
} qwen_zero;

/* QwenImageTransformerBlock: image x [B, si, C] and text c [B, st, C], joint attention. */
static mdt_status double_block(const qwen_block *blk, const mdt_dit *d, const mdt_rope *rope,
                               const mdt_heads *h, int64_t si, int64_t st, float *x, float *c,
                               int64_t i, const qwen_zero *z) {
    const int64_t C = blk->attn.to_out.out, B = d->B;
    /* TaylorSeer's slots: block i's image and text attention outputs */
    mdt_joint_rows r = {
        .x = x, .c = c, .si = si, .st = st, .ts = mdt_cache_taylor_of(d), .slot = 2 * i};
    float *mod = mdt_arena_floats(d->ar, B * (z ? 12 : 6) * C); // [B or 2B, 6C] image
    float *cmod = mdt_arena_floats(d->ar, B * 6 * C);           // [B, 6C] text
    if (!mod || !cmod || mdt_joint_rows_alloc(d, C, blk->attn.img.q.out_local, &r) != MDT_OK)
        return MDT_E_NOMEM;
    float *hb = mdt_arena_floats(d->ar, B * (si + st) * blk->img_ff0.out_local); // [B*n, 4C/T]
    if (!hb)
        return MDT_E_NOMEM;
    if (z) { /* img_mod of both timesteps in one product: [t rows | 0 rows] */
        mdt_dit dz = *d;
        dz.cond = z->condi, dz.cond_rows = 2 * B;
        MDT_TRY(mdt_dit_adaln(&dz, &blk->img_mod, mod)); // [2B, 6C]
        r.mi0 = mod + B * 6 * C, r.split = z->split;
    } else {
        MDT_TRY(mdt_dit_adaln(d, &blk->img_mod, mod)); // [B, 6C]
    }
    MDT_TRY(mdt_dit_adaln(d, &blk->txt_mod, cmod)); // [B, 6C]
    MDT_TRY(mdt_joint_attention(d, &blk->attn, mod, cmod, k_eps, rope, h, &r));
    const mdt_joint_ff ffx = {.x = x,
                              .n = si,
                              .mod = mod,
                              .eps = k_eps,
                              .nbuf = r.nx,
                              .hbuf = hb,
                              .ybuf = r.tmp,
                              .mod0 = r.mi0,
                              .split = r.split};
    const mdt_joint_ff ffc = {
        .x = c, .n = st, .mod = cmod, .eps = k_eps, .nbuf = r.nc, .hbuf = hb, .ybuf = r.tmp};
    MDT_TRY(mdt_joint_ff_gelu(d, &blk->img_ff0, &blk->img_ff2, &ffx)); // img_mlp
    return mdt_joint_ff_gelu(d, &blk->txt_ff0, &blk->txt_ff2, &ffc);   // txt_mlp
}

/* Batch elements [b0, b0 + n) that attend the same text tokens keep[0:Sv). */
typedef struct qwen_pass {
    int64_t b0, n;
    const int64_t *keep;
    int64_t Sv;
    mdt_cache *cache; /* the step cache (cache.h), or NULL */
} qwen_pass;

/* One pass: its elements' image rows and kept text rows split into P chunks each, the local
 * joint sequence [text chunk | image chunk] through the blocks, norm_out and proj_out on the
 * image rows, gathered into rows b0.. of `sample`; what their attention owes is added to `p`. */
static mdt_status qwen_run(const qwen *f, mdt_dit *d, const qwen_in *x, const float *cond,
                           const qwen_pass *ps, mdt_tensor *sample, mdt_promise *p) {
    const int64_t b0 = ps->b0, n = ps->n, Sv = ps->Sv;
    const int64_t *keep = ps->keep;
    const int64_t C = f->inner, J = f->joint_dim, Si = x->Si, O = f->proj_out.out;
    mdt_arena *ar = d->ar, *ha = d->ha;
    const mdt_arena_mark mk = mdt_arena_mark_get(ar), hk = mdt_arena_mark_get(ha);
    const void *hs, *ehs;
    int64_t s0i, si, s0t, st;
    float *txt = mdt_arena_floats(ha, n * Sv * J); // [n, Sv, J] host: the attended text rows
    if (!txt)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < n; b++)
        for (int64_t j = 0; j < Sv; j++)
            memcpy(txt + (b * Sv + j) * J, x->ehs + ((b0 + b) * x->St + keep[j]) * J,
                   sizeof(float) * (size_t)J);
    MDT_TRY(mdt_cp_take(&d->cp, "hidden_states", x->hs + b0 * Si * f->in_ch, 4, 3,
                        (int64_t[]){n, Si, f->in_ch}, ha, &hs, &s0i, &si));
    MDT_TRY(mdt_cp_take(&d->cp, "encoder_hidden_states", txt, 4, 3, (int64_t[]){n, Sv, J}, ha, &ehs,
                        &s0t, &st));
    mdt_rope rope;
    mdt_heads hd;
    mdt_controlnet ctl;
    MDT_TRY(rope_table(f, d, x, keep + s0t, st, s0i, si, &rope));
    MDT_TRY(mdt_controlnet_take(d, "controlnet_block_samples", x->ctl, b0, n, x->ctl_n, Si, C, 0,
                                x->ctl_shared, &ctl));
    d->B = n, d->cond = cond + b0 * C, d->cond_rows = n, d->cond_width = C;
    qwen_zero zero = {NULL, 0}; /* zero_cond_t: this pass's [t | 0] rows; its first image rows */
    if (f->zero_cond_t) {
        float *condi = mdt_arena_floats(ar, 2 * n * C); // [2n, C]
        if (!condi)
            return MDT_E_NOMEM;
        mdt_k()->copy2d(condi, 0, cond + b0 * C, 0, 1, n * C);
        mdt_k()->copy2d(condi + n * C, 0, cond + (x->B + b0) * C, 0, 1, n * C);
        zero.condi = condi;
        zero.split = x->n0 - s0i < 0 ? 0 : x->n0 - s0i; /* the global rows s0i.. are here */
    }
    const float *hs_d = mdt_k_upload(ar, hs, sizeof(float) * (size_t)(n * si * f->in_ch));
    const float *ehs_d = mdt_k_upload(ar, ehs, sizeof(float) * (size_t)(n * st * J));
    float *tn = mdt_arena_floats(ar, n * st * J); // [n, St/P, J] txt_norm(text)
    float *xs = mdt_arena_floats(ar, n * si * C); // [n, Si/P, C] image stream
    float *c = mdt_arena_floats(ar, n * st * C);  // [n, St/P, C] text stream
    float *emb = mdt_arena_floats(ar, n * 2 * C); // [n, 2C] norm_out (scale, shift)
    float *xn = mdt_arena_floats(ar, n * si * C); // [n, Si/P, C]
    float *ol = mdt_arena_floats(ar, n * si * O); // [n, Si/P, O]
    if (!hs_d || !ehs_d || !tn || !xs || !c || !emb || !xn || !ol ||
        mdt_dit_heads_alloc(d, st + si, &hd) != MDT_OK)
        return MDT_E_NOMEM;
    mdt_dit_linear(&f->img_in, hs_d, n * si, xs, C); // [n, Si/P, C]
    mdt_k()->rmsnorm(ehs_d, f->txt_norm, tn, n * st, J, k_eps);
    MDT_TRY(mdt_dit_slice_linear(d, &f->txt_in, tn, J, c, n * st)); // [n, St/P, C] reduced
    mdt_guard_finite(d->m, "img_in", xs, n * si * C);
    mdt_guard_finite(d->m, "txt_in", c, n * st * C);
    /* the step cache: the image stream's residual over block 0 decides (the text stream's
     * output is never read after the blocks, so only the image stream is cached) */
    mdt_cache *cache = ps->cache;
    const mdt_cache_rows img = {xs, si, C, si * C};
    float *x0;
    int skip = 0;
    int64_t ran = 0;
    MDT_TRY(mdt_cache_pre(cache, d, &img, &x0, &skip)); /* MagCache may skip every block */
    for (int64_t i = 0; i < f->layers && !skip; i++) {  /* a block's scratch is reused */
        const mdt_arena_mark bk = mdt_arena_mark_get(ar);
        MDT_TRY(double_block(&f->blk[i], d, &rope, &hd, si, st, xs, c, i,
                             f->zero_cond_t ? &zero : NULL));
        mdt_controlnet_add(&ctl, i, f->layers, xs, si * C); /* the ControlNet's residual */
        mdt_dit_block_done(d, bk, "transformer_blocks", i, (mdt_stream[]){{xs, si, C}, {c, st, C}},
                           2);
        ran++;
        if (i == 0) /* test seam: a rank failing mid-step */
            MDT_TRY(mdt_dit_test_point(d, "step"));
        if (i == 0) /* First-Block Cache may skip the rest */
            MDT_TRY(mdt_cache_after_first(cache, d, x0, &img, &skip));
    }
    MDT_TRY(mdt_cache_post(cache, d, x0, &img, skip, ran, f->layers));
    MDT_TRY(mdt_dit_adaln(d, &f->norm_out, emb)); // [n, 2C] scale first
    for (int64_t b = 0; b < n; b++)
        mdt_k()->layernorm_modulate(xs + b * si * C, xn + b * si * C, si, C, k_eps,
                                    emb + b * 2 * C + C, emb + b * 2 * C); // [Si/P, C]
    mdt_dit_linear(&f->proj_out, xn, n * si, ol, O);                       // [n, Si/P, O]
    mdt_guard_finite(d->m, "proj_out", ol, n * si * O);
    mdt_tensor part = *sample; /* rows b0 .. b0 + n of sample [B, Si, O] */
    part.shape[0] = n, part.data = (float *)sample->data + b0 * Si * O;
    MDT_TRY(mdt_cp_give(&d->cp, "sample", ar, ha, NULL, Si, ol, &part));
    /* no silent degrade: each query row once over the joint sequence, per block and element */
    const int predicted = mdt_cache_predicts(cache);
    mdt_dit_promise_cp(d, p, (int64_t[]){Sv, Si}, 2, predicted ? 0 : ran * n);
    mdt_arena_rewind(ar, mk), mdt_arena_rewind(ha, hk);
    return MDT_OK;
}

/* keep[0:Sv) = the text tokens element b attends (all without a mask); returns Sv. */
static int64_t kept_tokens(const qwen_in *x, int64_t b, int64_t *keep) {
    int64_t Sv = 0;
    for (int64_t j = 0; j < x->St; j++)
        if (!x->mask || x->mask[b * x->St + j])
            keep[Sv++] = j;
    return Sv;
}

static mdt_status qwen_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const qwen *f = m->impl;
    const double t_prep = mdt_now();
    mdt_dit d;
    qwen_in x;
    mdt_promise p = {0};
    mdt_tensor *o;
    mdt_dit_begin(&d, m, f->heads, f->head_dim);
    MDT_TRY(qwen_read(f, &d, in, &x));
    mdt_counters_get()->prep_s += mdt_now() - t_prep;
    const int64_t B = x.B, C = f->inner, St = x.St, Bc = f->zero_cond_t ? 2 * B : B;
    float *h1 = mdt_arena_floats(d.ar, Bc * C);   // [Bc, C]
    float *cond = mdt_arena_floats(d.ar, Bc * C); // [Bc, C] SiLU(temb): t, then (zero_cond_t) 0
    int64_t *keep = (int64_t *)(void *)mdt_arena_floats(d.ha, 2 * St); // [St] host
    if (!h1 || !cond || !keep)
        return MDT_E_NOMEM;
    /* temb = TimestepEmbedding(Timesteps(t)); every modulation reads SiLU(temb) */
    mdt_dit_mlp2(&f->t_lin1, &f->t_lin2, x.e256, Bc, h1, cond); // [Bc, C]
    for (int64_t r = 0; x.add_t && r < Bc; r++) /* + addition_t_embedding[additional_t_cond] */
        mdt_k()->add_bias(cond + r * C, C, f->add_t + x.add_t[r % B] * C, 1, C); // [1, C]
    mdt_k()->silu(cond, Bc * C);
    mdt_guard_finite(d.m, "time_text_embed", cond, Bc * C);
    MDT_TRY(
        mdt_tensor_set_add(out, "sample", MDT_F32, 3, (int64_t[]){B, x.Si, f->proj_out.out}, &o));
    /* one pass for the batch when every element attends the same text tokens, else one each */
    int same = 1;
    for (int64_t b = 1; x.mask && b < B; b++)
        same = same && memcmp(x.mask, x.mask + b * St, (size_t)St) == 0;
    mdt_cache *cache; /* refused before the cache begins, which leaves its state as it was */
    MDT_TRY(mdt_controlnet_check_cache(&d, x.ctl != NULL));
    if (mdt_cache_on(&d) && !same && B > 1)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "cache: the batch's elements attend different text tokens "
                        "(encoder_hidden_states_mask), so they run in separate passes, but the "
                        "cache decides once over the whole batch: send them one per forward");
    MDT_TRY(mdt_cache_begin(&d,
                            MDT_CACHE_BIT(MDT_CACHE_FIRST_BLOCK) | MDT_CACHE_BIT(MDT_CACHE_MAG) |
                                MDT_CACHE_BIT(MDT_CACHE_TAYLOR),
                            f->layers, &cache));
    for (int64_t b0 = 0, n = same ? B : 1; b0 < B; b0 += n) {
        const qwen_pass pass = {b0, n, keep, kept_tokens(&x, b0, keep), cache};
        MDT_TRY(qwen_run(f, &d, &x, cond, &pass, o, &p));
    }
    return mdt_dit_end(&d, &p);
}

/* The most square (1, h, w) grid of n rows: h the largest divisor of n up to sqrt(n). */
static void square_grid(int64_t n, int64_t *s) {
    int64_t h = 1;
    for (int64_t k = 2; k * k <= n; k++)
        h = n % k == 0 ? k : h;
    s[0] = 1, s[1] = h, s[2] = n / h;
}

/* ---- random inputs: one (1, h, w) image per element, the most square grid of S_img; under
 * use_layer3d_rope a layer and the input image (half the rows each, the pipeline's form), and
 * additional_t_cond 0 (the pipeline's is_rgb) under use_additional_t_cond ---- */
static mdt_status qwen_make_inputs(const void *impl, const mdt_inputs_params *p, mdt_rng *rng,
                                   mdt_tensor_set *out) {
    const qwen *f = impl;
    const int64_t B = p->batch, Si = p->img_tokens > 0 ? p->img_tokens : 16;
    const int64_t St = p->txt_tokens > 0 ? p->txt_tokens : 8, n = f->layer3d && Si >= 2 ? 2 : 1;
    mdt_tensor *mask, *shapes, *add_t;
    MDT_TRY(mdt_inputs_add_normal(out, "hidden_states", 3, (int64_t[]){B, Si, f->in_ch}, rng));
    MDT_TRY(mdt_inputs_add_normal(out, "encoder_hidden_states", 3, (int64_t[]){B, St, f->joint_dim},
                                  rng));
    MDT_TRY(mdt_tensor_set_add(out, "encoder_hidden_states_mask", MDT_I64, 2, (int64_t[]){B, St},
                               &mask));
    for (int64_t i = 0; i < B * St; i++)
        ((int64_t *)mask->data)[i] = 1;
    MDT_TRY(mdt_inputs_add_const(out, "timestep", B, p->timestep, NULL));
    MDT_TRY(mdt_tensor_set_add(out, "img_shapes", MDT_I64, 3, (int64_t[]){B, n, 3}, &shapes));
    for (int64_t b = 0; b < B; b++) {
        int64_t *s = (int64_t *)shapes->data + 3 * n * b;
        square_grid(Si - Si / 2 * (n - 1), s); /* the layer (or the one image) */
        if (n == 2)
            square_grid(Si / 2, s + 3); /* the input image */
    }
    if (!f->add_t_cond)
        return MDT_OK;
    MDT_TRY(mdt_tensor_set_add(out, "additional_t_cond", MDT_I64, 1, (int64_t[]){B}, &add_t));
    memset(add_t->data, 0, sizeof(int64_t) * (size_t)B);
    return MDT_OK;
}

/* The rows of hidden_states [B, Si, in] after each element's first image (img_shapes [B, n, 3] or
 * [B, 3], any integer dtype, as the forward reads it): the condition images Qwen-Image-Edit's
 * pipelines append to the latents being denoised and never step (diffusers' Qwen-Image pipelines
 * put nothing else after the first image). Under use_layer3d_rope the last image only, when
 * there are two or more: QwenImageLayeredPipeline steps every layer before its input image.
 * Shapes the forward would refuse keep nothing. */
static void qwen_clean_elements(const void *impl, const mdt_tensor_set *in,
                                const mdt_tensor *latent, const mdt_tensor *timestep,
                                unsigned char *keep) {
    const mdt_tensor *s = mdt_tensor_set_get(in, "img_shapes");
    const int layer3d = ((const qwen *)impl)->layer3d;
    (void)timestep;
    if (!s || latent->ndim != 3 || (s->ndim != 2 && s->ndim != 3) || s->shape[s->ndim - 1] != 3 ||
        mdt_tensor_numel(s) < 3)
        return;
    const int64_t B = latent->shape[0], Si = latent->shape[1], C = latent->shape[2];
    const int64_t n = s->ndim == 3 ? s->shape[1] : 1;
    int64_t rows = 0, n0 = 0;
    for (int64_t i = 0; i < n; i++) { /* element 0's images (the forward checks the others) */
        int64_t r = 1, v;
        for (int k = 0; k < 3; k++) {
            if (!mdt_input_int_at(s, 3 * i + k, &v) || v < 1 || v >= MDT_MAX_DIM)
                return; /* the forward's bounds (mdt_input_i64) */
            r *= v;
            if (r > Si)
                return;
        }
        if (layer3d ? i == n - 1 : i == 0) /* where the kept rows start */
            n0 = layer3d ? rows : r;
        rows += r;
        if (rows > Si)
            return;
    }
    if (rows != Si)
        return;
    if (layer3d && n < 2)
        return;
    for (int64_t b = 0; b < B; b++) /* rows [n0, Si) of every element */
        memset(keep + (b * Si + n0) * C, 1, (size_t)((Si - n0) * C));
}

/* QwenImagePipeline's true CFG rescales the combined prediction to the conditional one's norm */
const mdt_family mdt_family_qwenimage = {
    MDT_FAMILY_FIELDS(qwen, "qwenimage", "QwenImageTransformer2DModel", k_qwen_cp_plan, "sample"),
    .clean_elements = qwen_clean_elements, .cfg_rule = MDT_CFG_RESCALED};
