/*
 * model.h — what a model family provides and what the generic loader does with it.
 *
 * A family is data plus functions: it parses config.json into its own config, appends its
 * weight table (name, full shape, TP style, bind target) and names its CP plan; the generic code
 * (loader, gen, inspect, report) only reads those tables. Adding a model never touches the loader.
 * Weights live in one buffer per rank; activations in a per-model arena reset each forward.
 */
#ifndef MDT_MODEL_H
#define MDT_MODEL_H

#include "comm/mesh.h"
#include "io/checkpoint.h"
#include "parallel/plan.h"

/* Largest model dimension a config may declare (keeps every product of two dimensions far from
 * int64 overflow; real models are below 2^16). */
#define MDT_MAX_DIM ((int64_t)1 << 24)

typedef struct mdt_wtable {
    int n, cap;
    mdt_weight_spec *specs;
    const float ***bind;  /* bind[i]: where the loader stores the pointer to tensor i's data */
    struct mdt_lin **lin; /* lin[i]: the linear layer whose weight tensor i is, else NULL */
    int *required;        /* 0 for tensors a config may omit (none in Flux) */
} mdt_wtable;

/* A linear layer: the resident (local) weight [out_local, in_local], its bias, full dims. */
typedef struct mdt_lin {
    const float *w, *b;
    const uint16_t *wh; /* the weight in bf16 under --dtype bf16 (w is then NULL) */
    int64_t in, out;
} mdt_lin;

/* Appends `name`.weight [out, in] with `style` and, if `bias`, `name`.bias [out] (sharded with
 * the output for colwise styles; replicated and added once after the reduce for rowwise ones). */
mdt_status mdt_wtable_add_linear(mdt_wtable *t, mdt_lin *l, const char *name, int64_t out,
                                 int64_t in, mdt_tp_style style, int bias);

/* Appends a tensor of rank 1 or 2 (shape[1] ignored for rank 1). */
mdt_status mdt_wtable_add(mdt_wtable *t, const char *name, int ndim, int64_t d0, int64_t d1,
                          mdt_tp_style style, const float **bind);
void mdt_wtable_free(mdt_wtable *t);

/* Parameters of `meshdit inputs`; a family reads the fields it understands. */
typedef struct mdt_inputs_params {
    uint64_t seed;
    int64_t batch;
    int64_t img_tokens, txt_tokens;
    double timestep, guidance;
    int64_t audio_tokens; /* MiniMax-H3 */
} mdt_inputs_params;

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
    /* Random inputs for `meshdit inputs`. */
    mdt_status (*make_inputs)(const void *impl, const mdt_inputs_params *p, mdt_tensor_set *out);
    /* config.json text of a named preset ("tiny", "medium"), or NULL. */
    const char *(*preset)(const char *name);
    const mdt_cp_plan *cp_plan;
    const char *latent_input;   /* input the sampler integrates (Flux: hidden_states) */
    const char *timestep_input; /* input the sampler sets to sigma (Flux: timestep) */
    const char *output;         /* forward output (Flux: sample) */
} mdt_family;

/* The family named in config.json (`_class_name`), or by name ("flux"). */
mdt_status mdt_family_from_config(const cJSON *config, const mdt_family **out);
const mdt_family *mdt_family_by_name(const char *name);

/* Per-tensor state of a loaded model on this rank. */
typedef struct mdt_wstate {
    int64_t local[2];   /* local shape (dim 1 = 1 for rank-1 tensors) */
    float *data;        /* slice of the host weights buffer (NULL once on the device) */
    float *dev;         /* slice of the device buffer (f32 tensors) */
    uint16_t *devh;     /* slice of the device bf16 buffer (linear weights under bf16) */
    uint16_t *h;        /* slice of the host bf16 buffer (linear weights, CPU bf16) */
    mdt_dtype stored;   /* dtype in the checkpoint (gather writes it back in this dtype) */
    int64_t bytes_read; /* checkpoint bytes this rank read for it */
} mdt_wstate;

struct mdt_model {
    const mdt_family *fam;
    void *impl;
    cJSON *config;
    mdt_wtable table;
    mdt_wstate *ws;       /* [table.n] */
    float *weights;       /* one buffer for every resident tensor, f32 (but packed ones) */
    uint16_t *hbf16;      /* CPU bf16: the packed linear weights (NULL otherwise) */
    int64_t weight_bytes; /* resident weight bytes on this rank: local sizes x 4 (bf16: x 2) */
    int64_t bytes_read;   /* checkpoint bytes read by this rank */
    mdt_mesh *mesh;       /* borrowed; NULL = single rank */
    int T, tp_index;      /* TP degree and this rank's shard index */
    int sharded_at_load;
    mdt_arena arena;    /* activations: device memory on a device backend */
    mdt_arena harena;   /* host staging of inputs and host-side tables */
    int weights_pinned; /* host buffer from the backend's page-locked allocator */
    int on_device;      /* weights live in dev_f32 / dev_bf16, not in `weights` */
    float *dev_f32;
    uint16_t *dev_bf16;
    float *dev_scratch;  /* past the f32 slots: where bf16 weights pass in f32 on upload */
    mdt_counters fwd_c0; /* counters when the current forward began */
    int64_t fwd_g0[MDT_GROUP_COUNT]; /* group bytes when the current forward began */
};

/* Loads the weights of a described model from `ck`, each rank reading only its TP shards for
 * `mesh` (NULL: whole). Accepts ring/ulysses > 1 (the loader does not care); mdt_model_load
 * refuses them while context parallelism is not implemented. Collective. */
mdt_status mdt_model_load_ckpt(mdt_model *m, const mdt_ckpt *ck, mdt_mesh *mesh);
/* Checks a T x R x U layout against the model (heads, every sharded dim and packed block). */
mdt_status mdt_model_check_layout(const mdt_model *m, int T, int R, int U);
/* This rank's sequence split: P = ring x ulysses chunks, `chunk` = its CP index (P = 1, chunk 0
 * without a mesh, or under the test-only MESHDIT_TEST_SKIP_CP_SPLIT=1, which reproduces the
 * upstream bug of every rank computing the whole sequence so the promise check can catch it). */
void mdt_model_cp_split(const mdt_model *m, int *P, int *chunk);

/* Test-only failure injection: MESHDIT_TEST_FAIL=PHASE:RANK[:kill] makes world rank RANK fail
 * (or die by SIGKILL) at PHASE ("load": mid-load; "step": inside a forward, after its first
 * block) so tests can check that every rank exits. MDT_OK otherwise. */
mdt_status mdt_test_fail_point(const mdt_mesh *mesh, const char *phase);

/* Inputs: the tensor `name` of `in` with shape `shape` (-1 = any) converted to f32 (any float or
 * integer dtype) into the arena; NaN/Inf is an error naming the tensor and element. */
mdt_status mdt_input_f32(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         mdt_arena *a, float **out);
/* The same, read-only and without a copy when the input is already F32 (the large activations:
 * checked in place, uploaded straight from the caller's buffer); other dtypes are converted. */
mdt_status mdt_input_f32_view(const mdt_tensor_set *in, const char *name, int ndim,
                              const int64_t *shape, mdt_arena *a, const float **out);
/* Integer index input (I64/I32/I16/I8/U8) with every value in [lo, hi), as int64 in the arena. */
mdt_status mdt_input_i64(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         int64_t lo, int64_t hi, mdt_arena *a, int64_t **out);
/* Dimension `dim` of input `name`, or -1 when absent. */
int64_t mdt_input_dim(const mdt_tensor_set *in, const char *name, int dim);

/* Rowwise linear (plain, packed or replicated-input): y [M, out] = the sum over the TP group of
 * x_local [M, K_local] . W_local^T (rows ldx apart), then the full bias once: every TP peer adds
 * it to the same bit-identical sum. */
mdt_status mdt_row_linear(mdt_mesh *mesh, int T, const mdt_lin *l, const float *x, int64_t ldx,
                          int64_t K_local, float *y, int64_t M);
/* Context-parallel output gather: every CP chunk c (rows split of S into P) holds loc [B, n_c, O];
 * full [B, S, O] on every rank, chunks in order. Scratch from `ar`. */
mdt_status mdt_cp_gather_rows(mdt_mesh *mesh, mdt_arena *ar, int P, int64_t B, int64_t S, int64_t O,
                              const float *loc, float *full);

/* No silent NaN: every rank's rows x[0:n] of a forward stage (the embeddings, each block's
 * output, the final projection) must be finite. Collective over the world (every rank calls it
 * at the same stages, one tiny all-reduce): MDT_E_NUMERIC on every rank, naming the stage
 * (`what`, e.g. "transformer_blocks.3") and the lowest rank and element that went non-finite.
 * Activations in device memory are not scanned here (their final output is, on the host). */
mdt_status mdt_guard_finite(mdt_mesh *mesh, const char *what, const float *x, int64_t n);

/* No silent degrade: what one forward on this rank must have done under its layout. */
typedef struct mdt_promise {
    int64_t want_q, want_kv;   /* attention (head, query row) and (head, key row) pairs */
    int64_t whole_q;           /* query pairs if the sequence split did nothing */
    int64_t unscattered_q;     /* query pairs if Ulysses did not scatter heads */
    int64_t ringless_kv;       /* key pairs if the ring passed nothing */
    int owes[MDT_GROUP_COUNT]; /* groups that must have moved bytes */
} mdt_promise;
/* Compares what this forward did (counters and group bytes since mdt_model_forward began) with
 * the promise; MDT_E_INVALID naming the axis that did nothing otherwise. */
mdt_status mdt_model_check_promise(const mdt_model *m, const mdt_promise *p);

/* Moves pieces between a full tensor and the local shard of coordinate k of T:
 * to_local = 1: local <- full; 0: full <- local (the pieces k owns). */
void mdt_shard_copy(const mdt_weight_spec *w, int T, int k, float *full, float *local,
                    int to_local);

/* Creates a model from a config only (no weights; used by gen and inspect). */
mdt_status mdt_model_describe(const cJSON *config, mdt_model **out);

/* Writes a random-weight checkpoint in diffusers layout into `dir` (created if absent):
 * config.json (the given text), weights as one file or `shards` files plus an index, stored in
 * `dtype` (F32, BF16 or F16). Values: weights N(0, 1/in), biases N(0, 0.02^2), norm weights
 * 1 + N(0, 0.1^2), from `seed`. */
mdt_status mdt_model_gen(const char *config_text, uint64_t seed, mdt_dtype dtype, int shards,
                         const char *dir);

#endif /* MDT_MODEL_H */
