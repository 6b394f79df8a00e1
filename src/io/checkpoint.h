/*
 * checkpoint.h — a diffusers checkpoint directory: config.json plus either one
 * `diffusion_pytorch_model.safetensors` or shards listed by
 * `diffusion_pytorch_model.safetensors.index.json` (`weight_map`: tensor name -> shard file).
 *
 * Opening reads config.json and every shard's header (validated by safetensors.c), never tensor
 * data; lookups map a tensor name to (file, entry) so a caller can read any byte range of it.
 * Also: typed config.json accessors with errors that name the key. No MPI, no model knowledge.
 */
#ifndef MDT_CHECKPOINT_H
#define MDT_CHECKPOINT_H

#include "io/safetensors.h"

typedef struct cJSON cJSON;

#define MDT_CKPT_WEIGHTS "diffusion_pytorch_model.safetensors"
#define MDT_CKPT_INDEX "diffusion_pytorch_model.safetensors.index.json"
/* Largest config.json or index.json read (a real index of ~100,000 tensors is ~10 MB): with the
 * limits of safetensors.h and json.h, what opening a checkpoint may cost is bounded (errors.md). */
#define MDT_JSON_MAX_BYTES (64LL << 20)

typedef struct mdt_ckpt_ref {
    const char *name; /* borrowed from the entry */
    const mdt_st_file *file;
    const mdt_st_entry *entry;
} mdt_ckpt_ref;

typedef struct mdt_ckpt {
    char *dir;
    char *dir_shown; /* `dir` as messages show it (mdt_escape) */
    cJSON *config;
    int nfiles;
    mdt_st_file **files;
    char **shard_names;   /* [nfiles] the file names as the index gives them (raw) */
    mdt_st_budget opened; /* header bytes and tensor entries over all the shards */
    int n;
    mdt_ckpt_ref *refs; /* sorted by name */
} mdt_ckpt;

/* Opens `dir`. Errors: MDT_E_NOTFOUND (no config.json, no weights, a shard the index names but
 * the disk lacks, a tensor the index maps to a shard that lacks it), MDT_E_FORMAT (bad JSON or
 * safetensors), MDT_E_IO. */
mdt_status mdt_ckpt_open(const char *dir, mdt_ckpt **out);
void mdt_ckpt_close(mdt_ckpt *c);
/* Finds `name`; MDT_E_NOTFOUND with a message naming the tensor and the directory. */
mdt_status mdt_ckpt_find(const mdt_ckpt *c, const char *name, const mdt_ckpt_ref **out);

/* Reads config.json only (for `inspect` on a config without weights). */
mdt_status mdt_config_load(const char *path, cJSON **out);

/* A failure of the accessors below says "config.json: ..."; this names the file it came from
 * instead ("PATH: ..."), for a config read from `path` (a --config FILE, or DIR/config.json).
 * Returns st unchanged (MDT_OK passes through). */
mdt_status mdt_config_error_at(mdt_status st, const char *path);

/* Typed accessors: `def` is used when the key is absent (required = 0); with required = 1 a
 * missing key is an error. A present key of the wrong type is always an error. null is read as
 * diffusers reads None: the absent value of an Optional argument (an int or double whose default
 * here is 0 or less), false for a bool, and refused for a number with a number as its default
 * and for an array (diffusers would fail on it). */
mdt_status mdt_cfg_int(const cJSON *cfg, const char *key, int required, int64_t def, int64_t *out);
mdt_status mdt_cfg_bool(const cJSON *cfg, const char *key, int def, int *out);
mdt_status mdt_cfg_double(const cJSON *cfg, const char *key, double def, double *out);
/* Several integer (double) keys at once: `spec` lists "key=default" words in the order of dst
 * [n]; each is read as mdt_cfg_int(cfg, key, 0, default) (mdt_cfg_double) would. */
mdt_status mdt_cfg_ints(const cJSON *cfg, const char *spec, int64_t *const *dst, int n);
mdt_status mdt_cfg_doubles(const cJSON *cfg, const char *spec, double *const *dst, int n);
/* Integer array; `*n` in: capacity, out: count. Missing key -> count 0; null refused. */
mdt_status mdt_cfg_int_array(const cJSON *cfg, const char *key, int64_t *vals, int *n);
/* String value into *out, NULL when absent or null; a present value of another type is an error
 * ("config.json: 'K' must be a string, not a number"), MDT_E_INVALID. */
mdt_status mdt_cfg_string(const cJSON *cfg, const char *key, const char **out);

#endif /* MDT_CHECKPOINT_H */
