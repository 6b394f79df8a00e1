/*
 * model.h — a loaded model on this rank: its family and weight table (family.h), the state of
 * each of its tensors, where its weights and activations live, and the mesh it runs on. One
 * concept per file below this header: loader.c (describe, read shard-on-read, free),
 * residency.c (host / packed bf16 / device slots), parallelize.c (the in-memory path),
 * writer.c (gen, gather), inputs.c, forward.c (dispatch, no-NaN and no-silent-degrade checks).
 * Weights live in one buffer per rank; activations in a per-model arena reset each forward.
 */
#ifndef MDT_MODEL_H
#define MDT_MODEL_H

#include "comm/mesh.h"
#include "io/checkpoint.h"
#include "models/family.h"

/* Per-tensor state of a loaded model on this rank. */
typedef struct mdt_wstate {
    int64_t local[2];   /* local shape (dim 1 = 1 for rank-1 tensors) */
    float *data;        /* slice of the host weights buffer (NULL once on the device) */
    float *dev;         /* slice of the device buffer (f32 tensors) */
    uint16_t *devh;     /* slice of the device bf16 buffer (linear weights under bf16) */
    uint16_t *h;        /* slice of the host bf16 buffer (linear weights, CPU bf16) */
    int64_t slot;       /* floats of its slot in the host f32 buffer (0: none) */
    int64_t packed;     /* floats of data in the CPU GEMM's packed layout (0: data is plain) */
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
    /* the guarded forward (forward.c): the watchdog's bound and the longest forward so far, and
     * the first stage of the current forward whose rows went non-finite on this rank */
    double step_timeout, longest_s;
    /* set by a caller around a forward whose inputs are not the caller's own names (a guided
     * step's unconditional branch: negative_X given as X): a failure of this rank's forward says
     * it first, before the ranks agree, so every rank's message names it */
    const char *fail_label;
    char nan_stage[48];
    int64_t nan_elem; /* -1: none */
    /* the guards run so far in this forward (the same count on every rank of a cfg group: they
     * run the same stages; the two branches of cfg 2 may differ, e.g. a cache skipping blocks in
     * one) and the count when nan_stage went non-finite: the ranks agree on the earliest stage,
     * whichever rank saw it */
    int64_t guard_seq, nan_seq;
    struct mdt_lora_state *lora; /* LoRA adapters and what they did to the shards (lora.h) */
    struct mdt_cache *cache;     /* borrowed: the step cache of the next forwards (cache.h) */
};

/* Loads the weights of a described model from `ck`, each rank reading only its TP shards for
 * `mesh` (NULL: whole). Ring/ulysses only matter to the forward. Collective. */
mdt_status mdt_model_load_ckpt(mdt_model *m, const mdt_ckpt *ck, mdt_mesh *mesh);
/* Reads coordinate k of T's shard of `w` from `ref` into dst (f32, the local shape), only its
 * bytes: the loader's read, also the LoRA factors' and the base weights' read again. */
mdt_status mdt_model_read_shard(const mdt_ckpt_ref *ref, const mdt_weight_spec *w, int T, int k,
                                float *dst);
/* Checks a T x R x U layout against the model (heads, every sharded dim and packed block). */
mdt_status mdt_model_check_layout(const mdt_model *m, int T, int R, int U);
/* No silent NaN: this rank's rows x[0:n] of a forward stage (the embeddings, each block's
 * output, the final projection) must be finite. Local: the first stage that is not (`what`, e.g.
 * "transformer_blocks.3", and its element) is recorded, the forward goes on (every rank must
 * run the same collectives), and mdt_model_forward fails with MDT_E_NUMERIC naming it, agreed
 * with the other ranks once at the end of the forward. Activations in device memory are not
 * scanned here (the outputs are, on the host). */
void mdt_guard_finite(mdt_model *m, const char *what, const float *x, int64_t n);
/* The same over rows x[0:rows, 0:width] that every one of `parts` ranks holds alike (the TP
 * group's replicated rows): this rank scans its part `part` only (rows part*rows/parts up to
 * the next part's start), and reports an element as an index into the whole rows. */
void mdt_guard_finite_part(mdt_model *m, const char *what, const float *x, int64_t rows,
                           int64_t width, int parts, int part);

/* No silent degrade: what one forward on this rank must have done under its layout. */
typedef struct mdt_promise {
    int64_t want_q, want_kv;   /* attention (head, query row) and (head, key row) pairs */
    int64_t whole_q;           /* query pairs if the sequence split did nothing */
    int64_t unscattered_q;     /* query pairs if Ulysses did not scatter heads */
    int64_t ringless_kv;       /* key pairs if the ring passed nothing */
    int owes[MDT_GROUP_COUNT]; /* groups that must have moved bytes */
    int64_t cp_calls;          /* CP attention calls of the forward (dit.c) */
    int64_t ulysses_elems;     /* (head, row) pairs this rank's all-to-alls send and receive */
} mdt_promise;
/* Compares what this forward did (counters and group bytes since mdt_model_forward began) with
 * the promise; MDT_E_INVALID naming the axis that did nothing otherwise. */
mdt_status mdt_model_check_promise(const mdt_model *m, const mdt_promise *p);

/* Random inputs for a described or loaded model: the family's make_inputs with batch >= 1 and
 * an rng seeded with p->seed. */
mdt_status mdt_model_random_inputs(const mdt_model *m, const mdt_inputs_params *p,
                                   mdt_tensor_set *out);

/* The model's heads, head width, hidden and MLP widths as its family configured them (its own
 * defaults for the keys a config.json leaves out). */
mdt_model_dims mdt_model_dims_of(const mdt_model *m);
/* 1: the model's text reaches it through cross-attention (Wan), its own rows beside the
 * sequence; 0: the text rows are part of the joint sequence (Flux, Qwen-Image, ...). */
int mdt_model_cross_attention(const mdt_model *m);
/* 1: the family's pipeline guides (some input of this configuration has an unconditional
 * branch's own negative_NAME: MDT_IN_BRANCH); 0: a guided step is refused (MiniMax-H3). */
int mdt_model_guides(const mdt_model *m);

/* The step watchdog's bound for the model's next collective wait: its step timeout, or 10 x the
 * longest forward so far, at least 60 s. */
double mdt_model_step_bound(const mdt_model *m);

/* The family's declaration of input `name` for this model's configuration, or NULL when its
 * forward does not take it. */
const mdt_input_decl *mdt_model_input(const mdt_model *m, const char *name);

/* ---- batch.c: a forward's inputs cut by batch rows (the cfg axis' split) ---- */
/* 1 when t, input d of a batch of B > 1, is one value for every sample (dim 0 of 1, or 0-d, where
 * the family broadcasts it: a timestep [1] beside a latent [B, ...]). */
int mdt_input_shared_by_batch(const mdt_input_decl *d, const mdt_tensor *t, int64_t B);
/* The batch B >= 2 of `in` when its rows can be cut: the latent input's dim 0, which every
 * batched input of the family has in dim 0 (or 1 where it may be shared); 0 otherwise. */
int64_t mdt_model_batch_of(const mdt_model *m, const mdt_tensor_set *in);
/* *out (new): rows [b0, b0 + nb) of every batched input of `in` (batch B), the others whole. */
mdt_status mdt_model_inputs_rows(const mdt_model *m, const mdt_tensor_set *in, int64_t B,
                                 int64_t b0, int64_t nb, mdt_tensor_set **out);

/* Creates a model from a config only (no weights; used by gen and inspect). */
mdt_status mdt_model_describe(const cJSON *config, mdt_model **out);

/* Writes a random-weight checkpoint in diffusers layout into `dir` (created if absent):
 * config.json (the given text), weights as one file or `shards` files plus an index, stored in
 * `dtype` (F32, BF16 or F16). Values: weights N(0, 1/in), biases N(0, 0.02^2), norm weights
 * 1 + N(0, 0.1^2), from `seed`. */
mdt_status mdt_model_gen(const char *config_text, uint64_t seed, mdt_dtype dtype, int shards,
                         const char *dir);

#endif /* MDT_MODEL_H */
