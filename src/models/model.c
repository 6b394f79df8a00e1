/*
 * model.c — the generic half of every model: weight tables, family registry, the checkpoint
 * loader (validate every planned tensor's presence, shape and dtype, read it converted to f32 into
 * the one weights buffer), forward dispatch, and the random-checkpoint generator.
 */
#define _POSIX_C_SOURCE 200809L
#include "model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

extern const mdt_family mdt_family_flux;
static const mdt_family *const k_families[] = {&mdt_family_flux};
enum { N_FAMILIES = sizeof k_families / sizeof k_families[0] };

mdt_status mdt_wtable_add(mdt_wtable *t, const char *name, int ndim, int64_t d0, int64_t d1,
                          mdt_tp_style style, const float **bind) {
    if (strlen(name) >= MDT_NAME_MAX)
        return MDT_FAIL(MDT_E_INVALID, "weight name too long: %s", name);
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        mdt_weight_spec *s = mdt_calloc(sizeof *s * (size_t)cap);
        const float ***b = mdt_calloc(sizeof *b * (size_t)cap);
        int *r = mdt_calloc(sizeof *r * (size_t)cap);
        if (!s || !b || !r) {
            mdt_free(s), mdt_free((void *)b), mdt_free(r);
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        }
        if (t->n) {
            memcpy(s, t->specs, sizeof *s * (size_t)t->n);
            memcpy((void *)b, (const void *)t->bind, sizeof *b * (size_t)t->n);
            memcpy(r, t->required, sizeof *r * (size_t)t->n);
        }
        mdt_free(t->specs), mdt_free((void *)t->bind), mdt_free(t->required);
        t->specs = s, t->bind = b, t->required = r, t->cap = cap;
    }
    mdt_weight_spec *w = &t->specs[t->n];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    w->shape[0] = d0;
    w->shape[1] = ndim > 1 ? d1 : 0;
    w->style = style;
    t->bind[t->n] = bind;
    t->required[t->n] = 1;
    t->n++;
    return MDT_OK;
}

void mdt_wtable_free(mdt_wtable *t) {
    mdt_free(t->specs);
    mdt_free((void *)t->bind);
    mdt_free(t->required);
    memset(t, 0, sizeof *t);
}

const mdt_family *mdt_family_by_name(const char *name) {
    for (int i = 0; i < N_FAMILIES; i++)
        if (strcmp(k_families[i]->name, name) == 0 || strcmp(k_families[i]->class_name, name) == 0)
            return k_families[i];
    return NULL;
}

mdt_status mdt_family_from_config(const cJSON *config, const mdt_family **out) {
    const char *cls = mdt_cfg_str(config, "_class_name");
    *out = NULL;
    if (!cls)
        return MDT_FAIL(MDT_E_INVALID, "config.json: '_class_name' is missing (which model is "
                                       "this?)");
    *out = mdt_family_by_name(cls);
    if (!*out)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "config.json: model class '%s' is not supported "
                        "(supported: FluxTransformer2DModel)",
                        cls);
    return MDT_OK;
}

static int64_t spec_numel(const mdt_weight_spec *w) {
    return w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
}

mdt_status mdt_model_describe(const cJSON *config, mdt_model **out) {
    mdt_status st;
    const mdt_family *fam;
    *out = NULL;
    MDT_TRY(mdt_family_from_config(config, &fam));
    mdt_model *m = mdt_calloc(sizeof *m);
    if (!m)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    m->fam = fam;
    mdt_arena_init(&m->arena);
    m->impl = mdt_calloc(fam->impl_size);
    m->config = cJSON_Duplicate(config, 1);
    if (!m->impl || !m->config)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    MDT_CHECK(fam->configure(m->impl, m->config, &m->table));
    *out = m;
    return MDT_OK;
fail:
    mdt_model_free(m);
    return st;
}

mdt_load_params mdt_load_params_default(void) {
    mdt_load_params p = {NULL, 1, 1, 1};
    return p;
}

mdt_status mdt_model_load(const mdt_load_params *p, mdt_model **out) {
    mdt_status st;
    mdt_ckpt *ck = NULL;
    mdt_model *m = NULL;
    char sb1[96], sb2[96];
    *out = NULL;
    if (p->tp != 1 || p->ring != 1 || p->ulysses != 1)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "tp=%d ring=%d ulysses=%d requested, but this build runs single-rank only "
                        "(refusing to run a slower layout silently)",
                        p->tp, p->ring, p->ulysses);
    MDT_TRY(mdt_ckpt_open(p->checkpoint_dir, &ck));
    MDT_CHECK(mdt_model_describe(ck->config, &m));
    int64_t total = 0;
    for (int i = 0; i < m->table.n; i++)
        total += (spec_numel(&m->table.specs[i]) + 15) & ~(int64_t)15; /* 64-byte aligned slots */
    m->weights = mdt_alloc((size_t)(total > 0 ? total : 1) * sizeof(float));
    if (!m->weights)
        MDT_CHECK(
            MDT_FAIL(MDT_E_NOMEM, "out of memory for %lld weight bytes", (long long)total * 4));
    m->weight_bytes = total * 4;
    float *slot = m->weights;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        const mdt_ckpt_ref *ref;
        MDT_CHECK(mdt_ckpt_find(ck, w->name, &ref));
        const mdt_st_entry *e = ref->entry;
        int same = e->ndim == w->ndim;
        for (int d = 0; same && d < w->ndim; d++)
            same = e->shape[d] == w->shape[d];
        if (!same)
            MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                               "%s: tensor '%s': shape %s but config.json implies %s",
                               ref->file->path, w->name, mdt_shape_str(e->ndim, e->shape, sb1, 96),
                               mdt_shape_str(w->ndim, w->shape, sb2, 96)));
        if (!mdt_dtype_is_float(e->dtype))
            MDT_CHECK(MDT_FAIL(MDT_E_INVALID, "%s: tensor '%s': dtype %s is not a float type",
                               ref->file->path, w->name, mdt_dtype_name(e->dtype)));
        MDT_CHECK(mdt_st_read_f32(ref->file, e, 0, spec_numel(w), slot));
        *m->table.bind[i] = slot;
        slot += (spec_numel(w) + 15) & ~(int64_t)15;
    }
    if (ck->n > m->table.n)
        mdt_log(MDT_LOG_WARN, "%s: %d tensors in the checkpoint are not used by the model", ck->dir,
                ck->n - m->table.n);
    mdt_ckpt_close(ck);
    *out = m;
    return MDT_OK;
fail:
    mdt_ckpt_close(ck);
    mdt_model_free(m);
    return st;
}

void mdt_model_free(mdt_model *m) {
    if (!m)
        return;
    mdt_arena_release(&m->arena);
    mdt_wtable_free(&m->table);
    mdt_free(m->weights);
    mdt_free(m->impl);
    cJSON_Delete(m->config);
    mdt_free(m);
}

const char *mdt_model_family(const mdt_model *m) { return m->fam->name; }

mdt_status mdt_model_forward(mdt_model *m, const mdt_tensor_set *inputs, mdt_tensor_set *outputs) {
    if (!m->weights)
        return MDT_FAIL(MDT_E_INVALID, "model has no weights (described, not loaded)");
    MDT_TRY(mdt_arena_reset(&m->arena));
    return m->fam->forward(m->impl, &m->arena, inputs, outputs);
}

/* ---- gen ---- */
static mdt_status write_text(const char *path, const char *text) {
    FILE *fp = fopen(path, "wb");
    if (!fp)
        return MDT_FAIL(MDT_E_IO, "%s: cannot create: %s", path, strerror(errno));
    size_t n = strlen(text);
    int bad = fwrite(text, 1, n, fp) != n;
    bad |= fclose(fp) != 0;
    return bad ? MDT_FAIL(MDT_E_IO, "%s: write failed", path) : MDT_OK;
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
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        MDT_CHECK(MDT_FAIL(MDT_E_IO, "%s: cannot create directory: %s", dir, strerror(errno)));
    snprintf(path, sizeof path, "%s/config.json", dir);
    MDT_CHECK(write_text(path, config_text));

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
        ts[i].ndim = w->ndim;
        ts[i].shape[0] = w->shape[0];
        ts[i].shape[1] = w->shape[1];
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
    if (shards == 1) {
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_WEIGHTS);
        MDT_CHECK(mdt_st_write(path, n, names, tp, (const char *const[]){"format", "pt", NULL}));
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
            MDT_CHECK(mdt_st_write(path, hi - lo, names + lo, tp + lo,
                                   (const char *const[]){"format", "pt", NULL}));
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
fail:
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
