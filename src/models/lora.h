/*
 * lora.h — private to models/: LoRA adapters on a loaded model. lora.c reads an adapter file
 * (diffusers/peft keys mapped onto the model's weight table, every key accounted for, shapes
 * and kinds checked) and each rank's slices of its factors; lora_fuse.c folds the active
 * adapters into the resident shards and brings the base weights back. The public calls are in
 * meshdit.h (mdt_model_lora_*, mdt_model_set_adapters); docs/lora.md says what is accepted.
 */
#ifndef MDT_MODELS_LORA_H
#define MDT_MODELS_LORA_H

#include "models/model.h"

#define MDT_LORA_NAME_MAX 64

/* One adapted linear: the rows and columns of its factors this rank holds, cut as the weight
 * is (colwise and packed colwise: B's rows per block, A whole; rowwise, packed rowwise and
 * replicated-input rowwise: A's columns per block, B whole; replicated: both whole). */
typedef struct mdt_lora_target {
    int wi;       /* table index of the weight */
    int bi;       /* table index of its bias when the adapter has lora_B.bias, else -1 */
    int64_t rank; /* r */
    double scale; /* alpha / r (rsLoRA: alpha / sqrt r); 1 without an alpha */
    float *at;    /* A's slice, transposed: [in_local, r] */
    float *b;     /* B's slice: [out_local, r] */
    float *bias;  /* lora_B.bias's slice [out_local], or NULL */
    int64_t a_shape[2], b_shape[2]; /* full factor shapes (as 2-D views) */
    /* the factors' entries in the file mdt_lora_map read (valid while it is open) */
    const mdt_st_entry *ea, *eb, *ebias;
} mdt_lora_target;

typedef struct mdt_lora {
    char name[MDT_LORA_NAME_MAX];
    char source[MDT_ESC_NAME]; /* the file, as messages show it */
    int n;
    mdt_lora_target *t; /* [n], by table index */
    int64_t bytes;      /* host bytes of this rank's slices */
    int64_t bytes_read; /* adapter bytes this rank read */
    double weight;      /* in the active set */
    int active;
} mdt_lora;

/* Maps the adapter in `f` onto `t` (no factor data read): *out gets the targets (by table index,
 * factor pointers NULL) and *n their count. Every key must be accounted for: errors list the
 * keys that map to no linear weight of the table, name a module with one factor, a shape that
 * does not fit (the tensor and both shapes), an adapter kind that is not LoRA (DoRA, LoKr,
 * LoHa, OFT, full weight differences). `src` names the file in messages. */
mdt_status mdt_lora_map(const mdt_wtable *t, const mdt_st_file *f, const char *src,
                        mdt_lora_target **out, int *n);
/* Reads this rank's slices of every target's factors (TP degree T, coordinate k) from `f`. */
mdt_status mdt_lora_read(const mdt_wtable *t, const mdt_st_file *f, int T, int k, mdt_lora *l);
/* The weight spec a factor is cut by: A [r, in] (which = 'A') or B [out, r] ('B') of weight w,
 * sharded only where w's shard dim falls on it. */
mdt_weight_spec mdt_lora_factor_spec(const mdt_weight_spec *w, int64_t rank, char which);
void mdt_lora_free(mdt_lora *l);

/* A model's adapters and what they did to its shards (model.h: m->lora). */
typedef struct mdt_lora_file_id {
    long long dev, ino, size, mtime_s, mtime_ns;
} mdt_lora_file_id;

typedef struct mdt_lora_state {
    int n, cap;
    mdt_lora **a;        /* loaded adapters, in load order */
    unsigned char *done; /* [table.n] 1: the resident shard is not the base */
    void **copy;         /* [table.n] the base shard's resident bytes (copy mode), or NULL */
    int keep_copy;       /* mdt_lora_base: 1 = copy, 0 = re-read the checkpoint */
    char *ckpt_dir;      /* where the base weights come from (re-read mode) */
    int nfiles;
    char **file_names;     /* [nfiles] shard paths as the checkpoint opened them */
    mdt_lora_file_id *ids; /* [nfiles] their identity at load */
    int64_t copy_bytes;    /* host bytes of the kept copies */
    int64_t reread_bytes;  /* checkpoint bytes re-read for base weights, all calls */
    double fuse_s, base_s; /* seconds of the last set_adapters: fusing, bringing bases back */
} mdt_lora_state;

/* The state of m (created on first use); NULL only when out of memory (message set). */
mdt_lora_state *mdt_lora_state_of(mdt_model *m);
/* Notes, after a load, where the base weights can be read again: the checkpoint's directory
 * and each shard's identity (a later re-read refuses files that changed). */
mdt_status mdt_lora_note_checkpoint(mdt_model *m, const mdt_ckpt *ck);
void mdt_lora_state_free(mdt_model *m);
/* The run report's "adapters" array (every loaded adapter: name, file, active, weight, linear
 * weights adapted, ranks, this rank's factor bytes and bytes read) and the last fuse's seconds,
 * added to `report` (a cJSON object). */
struct cJSON;
void mdt_lora_report(const mdt_model *m, struct cJSON *report);
/* Restores every shard that is not the base (unfuse), marking them done = 0. Local. */
mdt_status mdt_lora_restore_all(mdt_model *m);

#endif /* MDT_MODELS_LORA_H */
