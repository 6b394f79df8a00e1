/*
 * checkpoint.c — see checkpoint.h. Shard names from the index are file names inside the
 * checkpoint directory: a name with '/' (so any absolute path), a leading '.' (so "..") or none
 * at all is refused, so the index cannot name a path outside it. A shard that is a symlink is
 * followed wherever it points: Hugging Face caches link every shard to a blob elsewhere, and the
 * safetensors reader validates whatever file it reaches.
 */
#define _POSIX_C_SOURCE 200809L
#include "checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/file.h"
#include "io/json.h"

enum { MDT_CKPT_SHOWN = 4096 }; /* room for a path as messages show it */

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = mdt_alloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

mdt_status mdt_config_error_at(mdt_status st, const char *path) {
    static const char lead[] = "config.json: ";
    const char *msg = mdt_last_error();
    if (st == MDT_OK || strncmp(msg, lead, sizeof lead - 1) != 0)
        return st;
    char rest[1600], shown[MDT_ESC_NAME];
    snprintf(rest, sizeof rest, "%s", msg + sizeof lead - 1);
    return MDT_FAIL(st, "%s: %s", mdt_escape(path, shown, sizeof shown), rest);
}

mdt_status mdt_config_load(const char *path, cJSON **out) {
    MDT_TRY(mdt_json_load_file(path, MDT_JSON_MAX_BYTES, out));
    char shown[MDT_ESC_NAME];
    const mdt_status st = mdt_json_unique_keys(*out, mdt_escape(path, shown, sizeof shown));
    if (st != MDT_OK) {
        cJSON_Delete(*out);
        *out = NULL;
    }
    return st;
}

static int cmp_ref(const void *a, const void *b) {
    return strcmp(((const mdt_ckpt_ref *)a)->name, ((const mdt_ckpt_ref *)b)->name);
}

/* Opens shard `fname` into c->files[c->nfiles] (the caller sized the arrays and opens each
 * shard once). */
static mdt_status add_file(mdt_ckpt *c, const char *fname, int *idx) {
    char shown[MDT_ESC_NAME];
    if (!fname[0] || strchr(fname, '/') || fname[0] == '.')
        return MDT_FAIL(MDT_E_FORMAT, "%s/%s: shard name '%s' is not a plain file name",
                        c->dir_shown, MDT_CKPT_INDEX, mdt_escape(fname, shown, sizeof shown));
    char *path = path_join(c->dir, fname);
    if (!path)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (!file_exists(path)) {
        mdt_free(path);
        return MDT_FAIL(MDT_E_NOTFOUND,
                        "%s/%s: shard named by %s is missing from the checkpoint directory",
                        c->dir_shown, mdt_escape(fname, shown, sizeof shown), MDT_CKPT_INDEX);
    }
    char *name = mdt_alloc(strlen(fname) + 1);
    if (!name) {
        mdt_free(path);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    memcpy(name, fname, strlen(fname) + 1);
    mdt_status st = mdt_st_open_budget(path, &c->opened, &c->files[c->nfiles]);
    mdt_free(path);
    if (st != MDT_OK) {
        mdt_free(name);
        return st;
    }
    c->shard_names[c->nfiles] = name;
    *idx = c->nfiles++;
    return MDT_OK;
}

static mdt_status alloc_files(mdt_ckpt *c, int nfiles) {
    c->files = mdt_calloc(sizeof(mdt_st_file *) * (size_t)(nfiles ? nfiles : 1));
    c->shard_names = mdt_calloc(sizeof(char *) * (size_t)(nfiles ? nfiles : 1));
    return c->files && c->shard_names ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
}

/* One weight_map entry: a tensor name and the shard the index puts it in (borrowed from the
 * parsed index). */
typedef struct wm_pair {
    const char *tensor, *shard;
} wm_pair;

static int cmp_pair_tensor(const void *a, const void *b) {
    return strcmp(((const wm_pair *)a)->tensor, ((const wm_pair *)b)->tensor);
}
static int cmp_pair_shard(const void *a, const void *b) {
    const wm_pair *x = a, *y = b;
    int r = strcmp(x->shard, y->shard);
    return r ? r : strcmp(x->tensor, y->tensor);
}

/* A tensor in the headers of two shards is ambiguous even when the index names one of them: a
 * tool reading the directory without the index would see two different tensors. */
typedef struct name_at {
    const char *name;
    int file;
} name_at;
static int cmp_name_at(const void *a, const void *b) {
    return strcmp(((const name_at *)a)->name, ((const name_at *)b)->name);
}
static mdt_status check_unique_across_shards(const mdt_ckpt *c) {
    int64_t total = 0, k = 0;
    for (int i = 0; i < c->nfiles; i++)
        total += c->files[i]->n;
    if (c->nfiles < 2 || total < 2)
        return MDT_OK;
    name_at *all = mdt_alloc(sizeof(name_at) * (size_t)total);
    if (!all)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int i = 0; i < c->nfiles; i++)
        for (int j = 0; j < c->files[i]->n; j++)
            all[k].name = c->files[i]->entries[j].name, all[k++].file = i;
    qsort(all, (size_t)total, sizeof *all, cmp_name_at);
    mdt_status st = MDT_OK;
    for (int64_t i = 1; i < total && st == MDT_OK; i++)
        if (strcmp(all[i - 1].name, all[i].name) == 0) {
            char nm[MDT_ESC_NAME], s1[MDT_ESC_NAME], s2[MDT_ESC_NAME];
            st = MDT_FAIL(MDT_E_FORMAT,
                          "%s: tensor '%s' is in two shards, %s and %s: which one holds it is "
                          "ambiguous",
                          c->dir_shown, mdt_escape(all[i].name, nm, sizeof nm),
                          mdt_escape(c->shard_names[all[i - 1].file], s1, sizeof s1),
                          mdt_escape(c->shard_names[all[i].file], s2, sizeof s2));
        }
    mdt_free(all);
    return st;
}

static mdt_status open_index(mdt_ckpt *c, const char *index_path) {
    cJSON *idx = NULL;
    wm_pair *pairs = NULL;
    mdt_status st;
    char nm[MDT_ESC_NAME], s1[MDT_ESC_NAME], s2[MDT_ESC_NAME];
    MDT_TRY(mdt_json_load_file(index_path, MDT_JSON_MAX_BYTES, &idx));
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
    if (!cJSON_IsObject(wm))
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s/%s: 'weight_map' is missing or not an object",
                           c->dir_shown, MDT_CKPT_INDEX));
    const cJSON *kv;
    int n = cJSON_GetArraySize(wm); /* every member (a repeated key counts twice) */
    if (n > MDT_ST_MAX_TOTAL_ENTRIES)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                           "%s/%s: weight_map lists %d tensors, over the limit of %d per "
                           "checkpoint",
                           c->dir_shown, MDT_CKPT_INDEX, n, MDT_ST_MAX_TOTAL_ENTRIES));
    pairs = mdt_alloc(sizeof(wm_pair) * (size_t)(n ? n : 1));
    c->refs = mdt_calloc(sizeof(mdt_ckpt_ref) * (size_t)(n ? n : 1));
    if (!pairs || !c->refs)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    int k = 0;
    cJSON_ArrayForEach(kv, wm) {
        if (!cJSON_IsString(kv))
            MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s/%s: weight_map['%s'] is not a string",
                               c->dir_shown, MDT_CKPT_INDEX,
                               mdt_escape(kv->string, nm, sizeof nm)));
        pairs[k].tensor = kv->string, pairs[k++].shard = kv->valuestring;
    }
    /* listed twice: JSON allows repeated keys, and cJSON keeps both */
    qsort(pairs, (size_t)n, sizeof *pairs, cmp_pair_tensor);
    for (int i = 1; i < n; i++)
        if (strcmp(pairs[i - 1].tensor, pairs[i].tensor) == 0)
            MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                               "%s/%s: tensor '%s' is listed twice in weight_map (shards '%s' and "
                               "'%s'): ambiguous",
                               c->dir_shown, MDT_CKPT_INDEX,
                               mdt_escape(pairs[i].tensor, nm, sizeof nm),
                               mdt_escape(pairs[i - 1].shard, s1, sizeof s1),
                               mdt_escape(pairs[i].shard, s2, sizeof s2)));
    /* by shard, so that each shard is opened once, in one pass */
    qsort(pairs, (size_t)n, sizeof *pairs, cmp_pair_shard);
    int nshards = 0;
    for (int i = 0; i < n; i++)
        nshards += i == 0 || strcmp(pairs[i - 1].shard, pairs[i].shard) != 0;
    MDT_CHECK(alloc_files(c, nshards));
    int fi = -1;
    for (int i = 0; i < n; i++) {
        if (i == 0 || strcmp(pairs[i - 1].shard, pairs[i].shard) != 0)
            MDT_CHECK(add_file(c, pairs[i].shard, &fi));
        const mdt_st_entry *e = mdt_st_find(c->files[fi], pairs[i].tensor);
        if (!e)
            MDT_CHECK(MDT_FAIL(MDT_E_NOTFOUND,
                               "%s: tensor '%s': the index maps it to this shard, which lacks it",
                               c->files[fi]->path, mdt_escape(pairs[i].tensor, nm, sizeof nm)));
        c->refs[c->n].name = e->name;
        c->refs[c->n].file = c->files[fi];
        c->refs[c->n].entry = e;
        c->n++;
    }
    MDT_CHECK(check_unique_across_shards(c));
    mdt_free(pairs);
    cJSON_Delete(idx);
    return MDT_OK;
fail:
    mdt_free(pairs);
    cJSON_Delete(idx);
    return st;
}

mdt_status mdt_ckpt_open(const char *dir, mdt_ckpt **out) {
    mdt_status st;
    char *p = NULL;
    *out = NULL;
    mdt_ckpt *c = mdt_calloc(sizeof *c);
    if (!c)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/')
        dl--;
    c->dir = mdt_alloc(dl + 1);
    if (!c->dir)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    memcpy(c->dir, dir, dl);
    c->dir[dl] = 0;
    c->dir_shown = mdt_alloc(MDT_CKPT_SHOWN);
    if (!c->dir_shown)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    mdt_escape(c->dir, c->dir_shown, MDT_CKPT_SHOWN);

    p = path_join(c->dir, "config.json");
    if (!p)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    if (!file_exists(p))
        MDT_CHECK(MDT_FAIL(MDT_E_NOTFOUND,
                           "%s: no config.json (not a diffusers checkpoint "
                           "directory?)",
                           c->dir_shown));
    MDT_CHECK(mdt_config_load(p, &c->config));
    mdt_free(p);

    p = path_join(c->dir, MDT_CKPT_INDEX);
    if (!p)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    if (file_exists(p)) {
        MDT_CHECK(open_index(c, p));
    } else {
        int fi;
        mdt_free(p);
        p = path_join(c->dir, MDT_CKPT_WEIGHTS);
        if (!p)
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        if (!file_exists(p))
            MDT_CHECK(MDT_FAIL(MDT_E_NOTFOUND, "%s: neither %s nor %s is present", c->dir_shown,
                               MDT_CKPT_WEIGHTS, MDT_CKPT_INDEX));
        MDT_CHECK(alloc_files(c, 1));
        MDT_CHECK(add_file(c, MDT_CKPT_WEIGHTS, &fi));
        const mdt_st_file *f = c->files[fi];
        c->refs = mdt_calloc(sizeof(mdt_ckpt_ref) * (size_t)(f->n ? f->n : 1));
        if (!c->refs)
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        for (int i = 0; i < f->n; i++) {
            c->refs[i].name = f->entries[i].name;
            c->refs[i].file = f;
            c->refs[i].entry = &f->entries[i];
        }
        c->n = f->n;
    }
    mdt_free(p);
    qsort(c->refs, (size_t)c->n, sizeof *c->refs, cmp_ref);
    *out = c;
    return MDT_OK;
fail:
    mdt_free(p);
    mdt_ckpt_close(c);
    return st;
}

void mdt_ckpt_close(mdt_ckpt *c) {
    if (!c)
        return;
    for (int i = 0; i < c->nfiles; i++)
        mdt_st_close(c->files[i]), mdt_free(c->shard_names[i]);
    mdt_free(c->files);
    mdt_free((void *)c->shard_names);
    mdt_free(c->dir_shown);
    mdt_free(c->refs);
    cJSON_Delete(c->config);
    mdt_free(c->dir);
    mdt_free(c);
}

mdt_status mdt_ckpt_find(const mdt_ckpt *c, const char *name, const mdt_ckpt_ref **out) {
    mdt_ckpt_ref key = {.name = name};
    *out = bsearch(&key, c->refs, (size_t)c->n, sizeof key, cmp_ref);
    if (!*out)
        return MDT_FAIL(MDT_E_NOTFOUND,
                        "%s: tensor '%s' is required by the model but missing "
                        "from the checkpoint",
                        c->dir_shown, name);
    return MDT_OK;
}

/* ---- config accessors ---- */
mdt_status mdt_cfg_int(const cJSON *cfg, const char *key, int required, int64_t def, int64_t *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(cfg, key);
    /* null is the absent value of an Optional argument (default None in diffusers: here a
     * default of 0 or less stands for it); for one with a number as its default diffusers takes
     * None as given and fails (range(None), Linear(None, ...)), so null is refused there */
    if (j && cJSON_IsNull(j) && (required || def > 0))
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: '%s' is null, but it must be an integer (its default, %lld, "
                        "applies only when the key is absent)",
                        key, (long long)def);
    if (!j || cJSON_IsNull(j)) {
        if (required)
            return MDT_FAIL(MDT_E_INVALID, "config.json: required key '%s' is missing", key);
        *out = def;
        return MDT_OK;
    }
    if (!cJSON_IsNumber(j) || floor(j->valuedouble) != j->valuedouble ||
        fabs(j->valuedouble) > 9007199254740992.0)
        return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must be an integer", key);
    *out = (int64_t)j->valuedouble;
    return MDT_OK;
}

mdt_status mdt_cfg_bool(const cJSON *cfg, const char *key, int def, int *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (!j) {
        *out = def;
        return MDT_OK;
    }
    if (cJSON_IsNull(j)) { /* diffusers passes None, which its modules test as false */
        *out = 0;
        return MDT_OK;
    }
    if (!cJSON_IsBool(j))
        return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must be true or false", key);
    *out = cJSON_IsTrue(j);
    return MDT_OK;
}

mdt_status mdt_cfg_double(const cJSON *cfg, const char *key, double def, double *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (j && cJSON_IsNull(j) && def > 0) /* as mdt_cfg_int: None only where None is the default */
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: '%s' is null, but it must be a number (its default, %g, "
                        "applies only when the key is absent)",
                        key, def);
    if (!j || cJSON_IsNull(j)) {
        *out = def;
        return MDT_OK;
    }
    if (!cJSON_IsNumber(j))
        return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must be a number", key);
    if (!isfinite(j->valuedouble)) /* e.g. 1e400: cJSON gives Inf */
        return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must be a finite number", key);
    *out = j->valuedouble;
    return MDT_OK;
}

mdt_status mdt_cfg_int_array(const cJSON *cfg, const char *key, int64_t *vals, int *n) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(cfg, key);
    int cap = *n;
    *n = 0;
    if (j && cJSON_IsNull(j)) /* every array read here has a tuple as diffusers' default */
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: '%s' is null, but it must be an array of integers (its "
                        "default applies only when the key is absent)",
                        key);
    if (!j)
        return MDT_OK;
    if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) > cap)
        return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must be an array of at most %d integers",
                        key, cap);
    const cJSON *v;
    cJSON_ArrayForEach(v, j) {
        if (!cJSON_IsNumber(v) || floor(v->valuedouble) != v->valuedouble ||
            fabs(v->valuedouble) > 9007199254740992.0)
            return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must hold integers", key);
        vals[(*n)++] = (int64_t)v->valuedouble;
    }
    return MDT_OK;
}

static const char *json_type_name(const cJSON *j) {
    return cJSON_IsNumber(j)   ? "a number"
           : cJSON_IsBool(j)   ? "true or false"
           : cJSON_IsArray(j)  ? "an array"
           : cJSON_IsObject(j) ? "an object"
                               : "another type";
}

mdt_status mdt_cfg_string(const cJSON *cfg, const char *key, const char **out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(cfg, key);
    *out = NULL;
    if (!j || cJSON_IsNull(j))
        return MDT_OK;
    if (!cJSON_IsString(j))
        return MDT_FAIL(MDT_E_INVALID, "config.json: '%s' must be a string, not %s", key,
                        json_type_name(j));
    *out = j->valuestring;
    return MDT_OK;
}

/* The next "key=value" word of *spec: key into `key` (NUL-terminated), the value's text at
 * *val; advances *spec. 0 at the end, -1 on a malformed spec (a programming error). */
static int spec_next(const char **spec, char *key, size_t cap, const char **val) {
    const char *p = *spec;
    while (*p == ' ')
        p++;
    if (!*p)
        return 0;
    const char *eq = strchr(p, '=');
    if (!eq || (size_t)(eq - p) >= cap)
        return -1;
    memcpy(key, p, (size_t)(eq - p));
    key[eq - p] = '\0';
    *val = eq + 1;
    for (p = eq + 1; *p && *p != ' ';)
        p++;
    *spec = p;
    return 1;
}

mdt_status mdt_cfg_ints(const cJSON *cfg, const char *spec, int64_t *const *dst, int n) {
    char key[96];
    const char *val;
    int i = 0, r;
    while ((r = spec_next(&spec, key, sizeof key, &val)) == 1 && i < n)
        MDT_TRY(mdt_cfg_int(cfg, key, 0, strtoll(val, NULL, 10), dst[i++]));
    if (r != 0 || i != n)
        return MDT_FAIL(MDT_E_INVALID, "internal: config spec does not list %d keys", n);
    return MDT_OK;
}

mdt_status mdt_cfg_doubles(const cJSON *cfg, const char *spec, double *const *dst, int n) {
    char key[96];
    const char *val;
    int i = 0, r;
    while ((r = spec_next(&spec, key, sizeof key, &val)) == 1 && i < n)
        MDT_TRY(mdt_cfg_double(cfg, key, strtod(val, NULL), dst[i++]));
    if (r != 0 || i != n)
        return MDT_FAIL(MDT_E_INVALID, "internal: config spec does not list %d keys", n);
    return MDT_OK;
}
