/*
 * family.h — what a model family provides: it parses config.json into its own config, appends
 * its weight table (name, full shape, TP style, bind target), declares its CP plan, and runs a
 * forward over its shards with the DiT toolkit (dit.h). The generic code (loader, residency,
 * writer, inspect, report) only reads those tables; registry.c is the only file that names the
 * families, so adding a model never touches the loader.
 */
#ifndef MDT_MODELS_FAMILY_H
#define MDT_MODELS_FAMILY_H

#include "core/core.h"
#include "parallel/plan.h"

#include <cjson/cJSON.h>

struct mdt_model;

/* Largest model dimension a config may declare (keeps every product of two dimensions far from
 * int64 overflow; real models are below 2^16). */
#define MDT_MAX_DIM ((int64_t)1 << 24)

typedef struct mdt_wtable {
    int n, cap;
    mdt_weight_spec *specs;
    const float ***bind;  /* bind[i]: where the loader stores the pointer to tensor i's data */
    struct mdt_lin **lin; /* lin[i]: the linear layer whose weight tensor i is, else NULL */
    int *required;        /* 0 for tensors a config may omit (none in Flux) */
    mdt_rows rows;        /* the rows of the linears declared next (mdt_wtable_rows) */
} mdt_wtable;

/* The rows the linears declared from now on multiply (plan.h: mdt_rows), until the next call;
 * returns the previous setting, so a helper that declares another stream can restore it. A
 * family's table says this as it goes (conditioning, embedders, each stream of a block); every
 * linear must have rows (mdt_wtable_check). */
mdt_rows mdt_wtable_rows(mdt_wtable *t, mdt_rows rows);
/* MDT_E_INVALID naming the first linear weight declared without rows. */
mdt_status mdt_wtable_check(const mdt_wtable *t);

/* A linear layer: the resident (local) weight [out_local, in_local], its bias, full dims. */
typedef struct mdt_lin {
    const float *w, *b;
    const uint16_t *wh;          /* the weight in bf16 under --dtype bf16 (w is then NULL) */
    int64_t in, out;             /* full dims */
    int64_t in_local, out_local; /* this rank's (set when the weights are bound) */
    int views; /* 1: the forward multiplies ranges of its rows on their own (row views of w),
                * so w stays row-major (never in the CPU GEMM's packed layout) */
} mdt_lin;

/* Appends `pfx name`.weight [out, in] with `style` and, if `bias`, `name`.bias [out] (sharded with
 * the output for colwise styles; replicated and added once after the reduce for rowwise ones). */
mdt_status mdt_wtable_add_linear(mdt_wtable *t, mdt_lin *l, const char *pfx, const char *name,
                                 int64_t out, int64_t in, mdt_tp_style style, int bias);

/* Appends a tensor of rank 1 or 2 (shape[1] ignored for rank 1). */
mdt_status mdt_wtable_add(mdt_wtable *t, const char *name, int ndim, int64_t d0, int64_t d1,
                          mdt_tp_style style, const float **bind);
/* Declares that tensor i of t, a 2-D view [d0, d1], is stored in the checkpoint with `ndim`
 * (3 .. MDT_MAX_DIMS) dims `shape`, shape[0] = d0 and the product of the rest = d1: a Conv3d
 * weight [out, in, kt, kh, kw] used as the linear [out, in kt kh kw], a table [1, 6, C] as
 * [1, 6 C]. The loader checks, and gen and gather write, the stored dims. */
mdt_status mdt_wtable_set_stored_shape(mdt_wtable *t, int i, int ndim, const int64_t *shape);
/* Lets the sharded tensors i >= `first` of t split unevenly over TP (plan.h: uneven): for widths
 * the forward takes from each rank's local shape alone, e.g. an FFN's hidden features. */
void mdt_wtable_set_uneven(mdt_wtable *t, int first);
/* Appends the replicated vector `pfx name` [n] (norm weights). */
mdt_status mdt_wtable_add_vector(mdt_wtable *t, const float **v, const char *pfx, const char *name,
                                 int64_t n);
void mdt_wtable_free(mdt_wtable *t);

/* MDT_E_UNSUPPORTED naming `family` and the first of dims[n] over MDT_MAX_DIM. */
mdt_status mdt_cfg_check_dims(const char *family, const int64_t *dims, size_t n);

/* Parameters of `meshdit inputs`; a family reads the fields it understands. */
typedef mdt_random_inputs mdt_inputs_params; /* (meshdit.h) */

/* The sizes the layout estimator and the calibration work from, as the family configured them
 * (its own defaults for the keys a config.json leaves out, its own MLP ratio). */
typedef struct mdt_model_dims {
    int64_t heads, head_dim; /* attention heads and the width of one */
    int64_t hidden;          /* the residual stream's width */
    int64_t ffn;             /* the MLP's hidden width */
    int text_cross; /* 1: the text reaches the blocks through cross-attention (its own rows beside
                     * the sequence, Wan); 0: the text rows are part of the joint sequence */
    /* attention calls of one forward, per sample: over the whole sequence (each block's
     * self-attention, joint or not), of the sequence over the text (cross-attention), and of
     * the text over itself (a text refiner, run whole on every rank) */
    int64_t self_attn, cross_attn, text_attn;
    int64_t out; /* the prediction's features per latent token (what a guided step exchanges) */
} mdt_model_dims;

/* One input a forward takes, under diffusers' argument name. */
enum {
    MDT_IN_BATCH = 1,  /* dim 0 is the batch: the cfg axis may split it between its groups */
    MDT_IN_BRANCH = 2, /* a guided step's unconditional branch has its own (negative_NAME) */
    /* with MDT_IN_BATCH: dim 0 may also be 1 for a larger batch, one value for every sample (the
     * forward broadcasts it: timestep, guidance); the cfg axis gives it whole to each part */
    MDT_IN_SHARED = 4,
    /* the forward takes it or not (Qwen-Image's mask: absent, every text row attends); with
     * MDT_IN_BRANCH, each branch has it or not on its own (diffusers' encode_prompt drops an
     * all-ones mask, so a negative prompt may come without one beside a positive one with one) */
    MDT_IN_OPTIONAL = 8,
};
typedef struct mdt_input_decl {
    const char *name;
    unsigned flags;
} mdt_input_decl;

/* How a guided step combines its branches' predictions v_c (conditional) and v_u, scale s: the
 * family's diffusers pipeline formula. */
typedef enum mdt_cfg_rule {
    MDT_CFG_PLAIN = 0, /* v = v_u + s (v_c - v_u)  (Flux true CFG, Flux.2, Wan) */
    MDT_CFG_RESCALED, /* the same, then each token's vector rescaled to |v_c|'s norm (Qwen-Image) */
} mdt_cfg_rule;

typedef struct mdt_family {
    const char *name;       /* "flux" */
    const char *class_name; /* diffusers _class_name */
    size_t impl_size;       /* bytes of the family's private state (zeroed) */
    /* Parses `config` into impl and appends the weight table. */
    mdt_status (*configure)(void *impl, const cJSON *config, mdt_wtable *t);
    /* Layout constraints beyond per-tensor divisibility (e.g. heads % tp), checked before any
     * weight is read; the message names the constraint and the numbers. */
    mdt_status (*check_layout)(const void *impl, int T, int R, int U);
    /* One forward on this rank over its shards (m->T, m->mesh); activations from m->arena only. */
    mdt_status (*forward)(struct mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out);
    /* Random inputs for `meshdit inputs` (p->batch >= 1; token counts <= 0: the family's
     * defaults), drawn from `rng` (see mdt_model_random_inputs). */
    mdt_status (*make_inputs)(const void *impl, const mdt_inputs_params *p, mdt_rng *rng,
                              mdt_tensor_set *out);
    const mdt_cp_plan *cp_plan;
    const char *latent_input;   /* input the sampler integrates (Flux: hidden_states) */
    const char *timestep_input; /* input the sampler sets to sigma (Flux: timestep) */
    double timestep_scale;      /* the sampler's timestep is sigma x this (0: 1; Wan: 1000) */
    /* Token rows per sequence of these inputs, for the memory estimate (NULL: what the CP plan
     * splits, as for Flux; Wan's latent is [B, C, F, H, W]; MiniMax-H3 adds its AdaLN table's
     * rows, 3 per timestep). */
    int64_t (*token_rows)(const void *impl, const mdt_tensor_set *in);
    /* The latent elements that are conditioning, which the sampler keeps as given: Wan 2.2
     * TI2V's clean first frame (a per-token timestep's zeros, which its pipeline puts back before
     * every forward and at the end); Qwen-Image-Edit's condition images (the rows after
     * img_shapes' first image, which its pipeline appends to the latents and never steps).
     * keep [numel(latent)] is zeroed by the caller; the hook sets 1 for each such element, or
     * leaves it all 0 where the shapes do not match (the forward then refuses them). `in`: the
     * forward's inputs. NULL: none. */
    void (*clean_elements)(const void *impl, const mdt_tensor_set *in, const mdt_tensor *latent,
                           const mdt_tensor *timestep, unsigned char *keep);
    const char *output; /* forward output (Flux: sample) */
    void (*dims)(const void *impl, mdt_model_dims *d);
    /* The inputs a forward of this configuration takes, NULL-terminated: any other name is
     * refused (a misspelt or unused input is never silently ignored). */
    const mdt_input_decl *(*inputs)(const void *impl);
    mdt_cfg_rule cfg_rule;
} mdt_family;

/* A family's descriptor, from its hooks PREFIX_configure, PREFIX_check_layout, PREFIX_forward,
 * PREFIX_make_inputs, PREFIX_dims and PREFIX_inputs, its private state type PREFIX, its CP plan
 * and its forward output; the sampler integrates "hidden_states" with the sigma in "timestep"
 * (diffusers' argument names) and a guided step combines plainly. Another rule or a hook more:
 * {MDT_FAMILY_FIELDS(...), .cfg_rule = ...} (qwenimage.c), or the descriptor written out (wan.c).
 */
#define MDT_FAMILY_FIELDS(PREFIX, NAME, CLASS, PLAN, OUTPUT)                                       \
    .name = NAME, .class_name = CLASS, .impl_size = sizeof(PREFIX),                                \
    .configure = PREFIX##_configure, .check_layout = PREFIX##_check_layout,                        \
    .forward = PREFIX##_forward, .make_inputs = PREFIX##_make_inputs, .cp_plan = &PLAN,            \
    .latent_input = "hidden_states", .timestep_input = "timestep", .output = OUTPUT,               \
    .dims = PREFIX##_dims, .inputs = PREFIX##_inputs
#define MDT_FAMILY(PREFIX, NAME, CLASS, PLAN, OUTPUT)                                              \
    { MDT_FAMILY_FIELDS(PREFIX, NAME, CLASS, PLAN, OUTPUT) }

/* A built-in config.json (configs/presets/FAMILY.NAME.json, embedded at build time). */
typedef struct mdt_preset {
    const char *family, *name, *text;
} mdt_preset;
extern const mdt_preset mdt_presets[]; /* ends with a NULL family */

/* The families this build knows, comma-separated: their names ("flux, minimax-h3, ...") or, with
 * class_names, their diffusers classes. Truncated to cap. */
void mdt_family_list(char *buf, size_t cap, int class_names);
/* Every preset by family: "flux: tiny, medium, ...; flux2: tiny; ...". Truncated to cap. */
void mdt_preset_list(char *buf, size_t cap);
/* config.json text of preset `name` of family `f` ("tiny", "medium"), or NULL. */
const char *mdt_family_preset(const mdt_family *f, const char *name);

/* The family named in config.json (`_class_name`), or by name ("flux"). */
mdt_status mdt_family_from_config(const cJSON *config, const mdt_family **out);
const mdt_family *mdt_family_by_name(const char *name);

#endif /* MDT_MODELS_FAMILY_H */
