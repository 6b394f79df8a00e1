/*
 * writer.c — checkpoints written in diffusers layout: `gen` (random weights for a config, one
 * file or shards plus an index) and `gather` (the TP shards of a loaded model back into one
 * ordinary checkpoint in each tensor's stored dtype, on world rank 0).
 */
#define _POSIX_C_SOURCE 200809L
#include "models/residency.h"

#include "core/outfile.h"
#include "core/sysmem.h"
#include "parallel/shard.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Checkpoint files appear whole (staged beside the target, renamed), never in place of a
 * non-regular file, with the mode of a new file (0666 & ~umask): core/outfile.h. */
static mdt_status write_text(const char *path, const char *text) {
    mdt_out o;
    MDT_TRY(mdt_out_begin(&o, path));
    mdt_status st = mdt_out_write(&o, text, strlen(text));
    if (st != MDT_OK) {
        mdt_out_abort(&o, 1);
        return st;
    }
    return mdt_out_commit(&o, 1);
}

static mdt_status write_weights(const char *path, int n, const char *const *names,
                                const mdt_tensor *const *tensors) {
    return mdt_st_write(path, n, names, tensors, (const char *const[]){"format", "pt", NULL});
}

/* A one-file checkpoint written into `dir` must be what loaders read: an index already there
 * would be read before it (here and in diffusers), so the new weights would be shadowed by old
 * shards. Refused before anything is written; nothing is deleted for the caller. */
static mdt_status no_index_in(const char *dir) {
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_INDEX);
    if (lstat(path, &sb) == 0)
        return MDT_FAIL(MDT_E_INVALID,
                        "%s holds a sharded checkpoint's %s, which loaders read before the %s "
                        "this writes: remove the old checkpoint or write to another directory",
                        dir, MDT_CKPT_INDEX, MDT_CKPT_WEIGHTS);
    return MDT_OK;
}

static int64_t spec_numel(const mdt_weight_spec *w) {
    return w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
}

/* The bytes of m's whole checkpoint in dtype (MDT_DTYPE_COUNT: each tensor's stored dtype), and
 * in *widest the element count of its largest tensor. */
static double checkpoint_bytes(const mdt_model *m, mdt_dtype dtype, double *widest) {
    double bytes = 0;
    *widest = 0;
    for (int i = 0; i < m->table.n; i++) {
        const double e = (double)spec_numel(&m->table.specs[i]);
        const mdt_dtype dt = dtype != MDT_DTYPE_COUNT ? dtype : m->ws ? m->ws[i].stored : MDT_F32;
        bytes += e * (double)mdt_dtype_size(dt);
        *widest = e > *widest ? e : *widest;
    }
    return bytes;
}

static void fill_random(const mdt_weight_spec *w, mdt_rng *rng, float *dst) {
    int64_t n = spec_numel(w);
    size_t len = strlen(w->name);
    int is_bias = len > 5 && strcmp(w->name + len - 5, ".bias") == 0;
    double std = is_bias ? 0.02 : w->ndim == 1 ? 0.1 : 1.0 / sqrt((double)w->shape[1]);
    double mean = (!is_bias && w->ndim == 1) ? 1.0 : 0.0;
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)(mean + std * mdt_rng_normal(rng));
}

/* The files gen (or gather: shards 1) writes into dir, then dir itself: a failed write's
 * leftovers in a directory it created (each file appeared whole or not at all: outfile.h). */
static void remove_written(const char *dir, int shards) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    remove(path);
    snprintf(path, sizeof path, "%s/%s", dir, shards == 1 ? MDT_CKPT_WEIGHTS : MDT_CKPT_INDEX);
    remove(path);
    for (int s = 0; shards > 1 && s < shards; s++) {
        snprintf(path, sizeof path, "%s/diffusion_pytorch_model-%05d-of-%05d.safetensors", dir,
                 s + 1, shards);
        remove(path);
    }
    rmdir(dir);
}

static mdt_status gather_host(mdt_model *m, const char *dir) {
    mdt_status st = MDT_OK;
    mdt_mesh *mesh = m->mesh;
    const int T = m->T, me = mesh ? mesh->world_rank : 0;
    const int n = m->table.n;
    mdt_tensor *ts = mdt_calloc(sizeof(mdt_tensor) * (size_t)(n ? n : 1));
    const mdt_tensor **tp = mdt_calloc(sizeof(const mdt_tensor *) * (size_t)(n ? n : 1));
    const char **names = mdt_calloc(sizeof(const char *) * (size_t)(n ? n : 1));
    float *full = NULL, *all = NULL;
    int64_t *counts = mdt_calloc(sizeof(int64_t) * (size_t)T); /* [T] shard sizes */
    if (!ts || !tp || !names || !counts)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int i = 0; st == MDT_OK && i < n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        const int64_t numel = w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
        int64_t total = 0;
        for (int r = 0; r < T; r++) { /* each coordinate's shard: uneven splits differ */
            int64_t loc[2];
            mdt_shard_local_shape(w, T, r, loc); /* the layout was checked at load */
            counts[r] = w->ndim > 1 ? loc[0] * loc[1] : loc[0], total += counts[r];
        }
        full = mdt_alloc(sizeof(float) * (size_t)numel);
        all = T > 1 ? mdt_alloc(sizeof(float) * (size_t)total) : NULL;
        if (!full || (T > 1 && !all)) {
            st = MDT_FAIL(MDT_E_NOMEM, "out of memory gathering '%s'", w->name);
            break;
        }
        if (T > 1 && mesh) { /* rank-major concatenation of the shards, then each to its place */
            st = mdt_allgatherv_floats(mesh, MDT_GROUP_TP, m->ws[i].data, all, counts);
            for (int64_t r = 0, off = 0; st == MDT_OK && r < T; off += counts[r], r++)
                mdt_shard_copy(w, T, (int)r, full, all + off, 0);
        } else {
            memcpy(full, m->ws[i].data, sizeof(float) * (size_t)numel);
        }
        if (st == MDT_OK && me == 0) {
            ts[i].dtype = m->ws[i].stored;
            ts[i].ndim = mdt_weight_stored_shape(w, ts[i].shape);
            ts[i].data = mdt_alloc(mdt_dtype_size(ts[i].dtype) * (size_t)numel);
            st = ts[i].data ? mdt_convert_from_f32(ts[i].dtype, full, ts[i].data, numel)
                            : MDT_FAIL(MDT_E_NOMEM, "out of memory");
            tp[i] = &ts[i];
            names[i] = w->name;
        }
        mdt_free(full), mdt_free(all);
        full = all = NULL;
    }
    if (st == MDT_OK && me == 0) {
        char path[4096];
        char *cfg = cJSON_Print(m->config);
        int created = 0;
        st = no_index_in(dir);
        if (st == MDT_OK && !cfg)
            st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
        if (st == MDT_OK && mkdir(dir, 0777) == 0)
            created = 1;
        else if (st == MDT_OK && errno != EEXIST)
            st = MDT_FAIL(MDT_E_IO, "%s: cannot create directory: %s", dir, strerror(errno));
        /* as gen: the weights first, config.json last, nothing left in a directory made here */
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_WEIGHTS);
        if (st == MDT_OK)
            st = write_weights(path, n, names, tp);
        snprintf(path, sizeof path, "%s/config.json", dir);
        if (st == MDT_OK)
            st = write_text(path, cfg);
        if (st != MDT_OK && created)
            remove_written(dir, 1);
        cJSON_free(cfg);
    }
    for (int i = 0; ts && i < n; i++)
        mdt_free(ts[i].data);
    mdt_free(ts), mdt_free((void *)tp), mdt_free((void *)names), mdt_free(counts);
    return mdt_mesh_agree(mesh, st);
}

/* World rank 0 holds the whole checkpoint in its stored dtypes before it writes, plus the
 * widest tensor's f32 gathered twice: that must fit what it may use (mdt_mem_budget). Other
 * ranks: MDT_OK. */
static mdt_status gather_fits(const mdt_model *m) {
    if (m->mesh && m->mesh->world_rank != 0)
        return MDT_OK;
    double widest;
    const double need = checkpoint_bytes(m, MDT_DTYPE_COUNT, &widest) + 8.0 * widest;
    return mdt_mem_fits(need, "gather: the whole checkpoint takes", " on rank 0",
                        "; nothing written");
}

mdt_status mdt_model_gather(mdt_model *m, const char *dir) {
    MDT_TRY(mdt_mesh_agree(m->mesh, gather_fits(m)));
    MDT_TRY(mdt_mesh_agree(m->mesh, mdt_res_to_host(m)));
    MDT_TRY(gather_host(m, dir));
    return mdt_mesh_agree(m->mesh, mdt_res_to_device(m));
}

mdt_status mdt_model_gen(const char *config_text, uint64_t seed, mdt_dtype dtype, int shards,
                         const char *dir) {
    mdt_status st = MDT_OK;
    mdt_model *m = NULL;
    mdt_tensor *ts = NULL;
    const mdt_tensor **tp = NULL;
    const char **names = NULL;
    cJSON *index = NULL;
    char *idx_txt = NULL;
    char path[4096];
    int created = 0;
    if (dtype != MDT_F32 && dtype != MDT_BF16 && dtype != MDT_F16)
        return MDT_FAIL(MDT_E_INVALID, "gen: --dtype must be f32, bf16 or f16");
    cJSON *cfg = cJSON_Parse(config_text);
    if (!cfg || !cJSON_IsObject(cfg)) {
        cJSON_Delete(cfg);
        return MDT_FAIL(MDT_E_FORMAT, "gen: config is not a JSON object");
    }
    st = mdt_model_describe(cfg, &m);
    cJSON_Delete(cfg);
    MDT_TRY(st);
    int n = m->table.n;
    if (shards < 1 || shards > n)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID, "gen: --shards must be between 1 and %d", n));
    if (shards == 1)
        MDT_CHECK(no_index_in(dir));
    /* the whole checkpoint is made in memory before anything is written: it must fit what this
     * process may use (MESHDIT_MEM_AVAILABLE, or MemAvailable and the cgroup's limit) */
    double widest;
    char what[64], in_dt[32];
    snprintf(what, sizeof what, "gen: the checkpoint's %d tensors take", n);
    snprintf(in_dt, sizeof in_dt, " in %s", mdt_dtype_name(dtype));
    MDT_CHECK(mdt_mem_fits(checkpoint_bytes(m, dtype, &widest) + 4.0 * widest, /* + f32 draws */
                           what, in_dt, "; nothing written"));

    ts = mdt_calloc(sizeof *ts * (size_t)n);
    tp = mdt_calloc(sizeof(const mdt_tensor *) * (size_t)n);
    names = mdt_calloc(sizeof *names * (size_t)n);
    if (!ts || !tp || !names)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    mdt_rng rng;
    mdt_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t numel = spec_numel(w);
        float *tmp = mdt_alloc(sizeof(float) * (size_t)numel);
        ts[i].dtype = dtype;
        ts[i].ndim = mdt_weight_stored_shape(w, ts[i].shape);
        ts[i].data = mdt_alloc(mdt_dtype_size(dtype) * (size_t)numel);
        if (!tmp || !ts[i].data) {
            mdt_free(tmp);
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        }
        fill_random(w, &rng, tmp);
        st = mdt_convert_from_f32(dtype, tmp, ts[i].data, numel);
        mdt_free(tmp);
        MDT_CHECK(st);
        tp[i] = &ts[i];
        names[i] = w->name;
    }
    /* written once made: the weights (shards and index), config.json last; a directory this
     * call created is removed again if a write fails */
    if (mkdir(dir, 0777) == 0)
        created = 1;
    else if (errno != EEXIST)
        MDT_CHECK(MDT_FAIL(MDT_E_IO, "%s: cannot create directory: %s", dir, strerror(errno)));
    if (shards == 1) {
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_WEIGHTS);
        MDT_CHECK(write_weights(path, n, names, tp));
    } else {
        index = cJSON_CreateObject();
        cJSON *meta = cJSON_AddObjectToObject(index, "metadata");
        cJSON *wm = cJSON_AddObjectToObject(index, "weight_map");
        int64_t total = 0;
        for (int s = 0; s < shards; s++) {
            int lo = (int)((int64_t)s * n / shards), hi = (int)((int64_t)(s + 1) * n / shards);
            char fname[128];
            snprintf(fname, sizeof fname, "diffusion_pytorch_model-%05d-of-%05d.safetensors", s + 1,
                     shards);
            snprintf(path, sizeof path, "%s/%s", dir, fname);
            MDT_CHECK(write_weights(path, hi - lo, names + lo, tp + lo));
            for (int i = lo; i < hi; i++) {
                cJSON_AddStringToObject(wm, names[i], fname);
                total += mdt_tensor_nbytes(&ts[i]);
            }
        }
        cJSON_AddNumberToObject(meta, "total_size", (double)total);
        idx_txt = cJSON_Print(index);
        if (!idx_txt)
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_INDEX);
        MDT_CHECK(write_text(path, idx_txt));
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    MDT_CHECK(write_text(path, config_text));
fail:
    if (st != MDT_OK && created) /* nothing of a failed gen stays in a directory it made */
        remove_written(dir, shards);
    if (ts)
        for (int i = 0; i < n; i++)
            mdt_free(ts[i].data);
    mdt_free(ts);
    mdt_free((void *)tp);
    mdt_free((void *)names);
    cJSON_free(idx_txt);
    cJSON_Delete(index);
    mdt_model_free(m);
    return st;
}
