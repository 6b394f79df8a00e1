/*
 * cache.c — the step caches of cache.h: the spec, a generation's branches, and First-Block
 * Cache's decision and residuals as diffusers' hooks/first_block_cache.py computes them.
 */
#include "models/cache.h"

#include "backend/backend.h"
#include "models/dit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the spec ---- */

static mdt_status parse_double(const char *v, const char *key, double lo, double *out) {
    char *end = NULL;
    const double x = strtod(v, &end);
    if (!*v || *end || !isfinite(x) || x < lo)
        return MDT_FAIL(MDT_E_INVALID, "cache spec: %s=%s is not a number >= %g", key, v, lo);
    *out = x;
    return MDT_OK;
}

mdt_status mdt_cache_spec_parse(const char *s, mdt_cache_spec *out) {
    *out = (mdt_cache_spec){.kind = MDT_CACHE_OFF, .threshold = 0.05};
    if (!s || !*s || strcmp(s, "none") == 0)
        return MDT_OK;
    char buf[256];
    if (strlen(s) >= sizeof buf)
        return MDT_FAIL(MDT_E_INVALID, "cache spec: the spec is longer than %zu bytes",
                        sizeof buf - 1);
    snprintf(buf, sizeof buf, "%s", s);
    char *args = strchr(buf, ':');
    if (args)
        *args++ = '\0';
    if (strcmp(buf, "first_block") == 0 || strcmp(buf, "fbc") == 0)
        out->kind = MDT_CACHE_FIRST_BLOCK;
    else
        return MDT_FAIL(MDT_E_INVALID,
                        "cache spec: unknown cache '%.64s' (meshdit has first_block, as diffusers' "
                        "FirstBlockCacheConfig)",
                        buf);
    for (char *kv = args ? strtok(args, ",") : NULL; kv; kv = strtok(NULL, ",")) {
        char *v = strchr(kv, '=');
        if (!v)
            return MDT_FAIL(MDT_E_INVALID, "cache spec: '%.64s' is not key=value", kv);
        *v++ = '\0';
        if (strcmp(kv, "threshold") == 0)
            MDT_TRY(parse_double(v, kv, 0.0, &out->threshold));
        else
            return MDT_FAIL(MDT_E_INVALID,
                            "cache spec: first_block has no key '%.64s' (it takes threshold)", kv);
    }
    return MDT_OK;
}

mdt_status mdt_cache_spec_check(const char *spec, int *enabled) {
    mdt_cache_spec sp;
    *enabled = 0;
    MDT_TRY(mdt_cache_spec_parse(spec, &sp));
    *enabled = sp.kind != MDT_CACHE_OFF;
    return MDT_OK;
}

void mdt_cache_spec_str(const mdt_cache_spec *sp, char *buf, size_t cap) {
    if (sp->kind == MDT_CACHE_FIRST_BLOCK) {
        /* the shortest text that reads back as the same double */
        char t[32];
        snprintf(t, sizeof t, "%.15g", sp->threshold);
        if (strtod(t, NULL) != sp->threshold)
            snprintf(t, sizeof t, "%.17g", sp->threshold);
        snprintf(buf, cap, "first_block:threshold=%s", t);
    } else
        snprintf(buf, cap, "none");
}

/* ---- a generation's state ---- */

mdt_status mdt_cache_create(const mdt_cache_spec *sp, mdt_cache **out) {
    mdt_cache *c = calloc(1, sizeof *c);
    if (!c)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    c->spec = *sp, c->cur = -1;
    *out = c;
    return MDT_OK;
}

static void branch_clear(mdt_cache_branch *b) {
    mdt_free(b->prev_res);
    for (int k = 0; k < MDT_CACHE_STREAMS; k++)
        mdt_free(b->head[k]), mdt_free(b->tail[k]);
    char name[sizeof b->name];
    memcpy(name, b->name, sizeof name);
    memset(b, 0, sizeof *b);
    memcpy(b->name, name, sizeof name);
}

void mdt_cache_free(mdt_cache *c) {
    if (!c)
        return;
    for (int i = 0; i < c->nbranches; i++)
        branch_clear(&c->br[i]);
    free(c->log);
    free(c);
}

mdt_status mdt_cache_select(mdt_cache *c, const char *branch) {
    if (!branch || !*branch)
        return MDT_FAIL(MDT_E_INVALID, "cache: a cached forward needs a branch name "
                                       "(diffusers: the cache_context name, e.g. \"cond\")");
    if (strlen(branch) > MDT_CACHE_NAME_MAX)
        return MDT_FAIL(MDT_E_INVALID, "cache: a branch name is at most %d bytes",
                        MDT_CACHE_NAME_MAX);
    for (int i = 0; i < c->nbranches; i++)
        if (strcmp(c->br[i].name, branch) == 0) {
            c->cur = i;
            return MDT_OK;
        }
    if (c->nbranches == MDT_CACHE_BRANCHES)
        return MDT_FAIL(MDT_E_INVALID, "cache: at most %d branches per generation",
                        MDT_CACHE_BRANCHES);
    mdt_cache_branch *b = &c->br[c->nbranches];
    memset(b, 0, sizeof *b);
    snprintf(b->name, sizeof b->name, "%s", branch);
    c->cur = c->nbranches++;
    return MDT_OK;
}

int64_t mdt_cache_skipped(const mdt_cache *c) {
    int64_t n = 0;
    for (int64_t i = 0; i < c->nlog; i++)
        n += c->log[i].skipped;
    return n;
}

/* ---- the forward's part ---- */

static double flops_now(void) {
    const mdt_counters *k = mdt_counters_get();
    double s = 0;
    for (int i = 0; i < MDT_FLOP_KIND_COUNT; i++)
        s += k->flops[i];
    return s;
}

mdt_status mdt_cache_begin(const mdt_dit *d, int supported, int64_t blocks, mdt_cache **out) {
    mdt_cache *c = d->m->cache;
    *out = NULL;
    if (!c || c->spec.kind == MDT_CACHE_OFF)
        return MDT_OK;
    if (!supported)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "cache: first_block is not implemented for %s (meshdit caches Flux, "
                        "Qwen-Image and Wan, as diffusers' hooks do)",
                        d->m->fam->class_name);
    if (blocks < 2)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: first_block needs at least 2 transformer blocks (the model has "
                        "%lld)",
                        (long long)blocks);
    if (mdt_backend_mem())
        return MDT_FAIL(MDT_E_UNSUPPORTED, "cache: first_block runs on the CPU backend only");
    if (c->cur < 0)
        return MDT_FAIL(MDT_E_INVALID, "cache: no branch selected for this forward");
    c->in_forward = 1;
    c->last = (mdt_cache_step){.branch = c->cur, .diff = NAN};
    *out = c;
    return MDT_OK;
}

/* A buffer of n floats for the branch, kept across forwards; its size fixed once made. */
static mdt_status keep_buf(mdt_cache *c, float **p, int64_t *have, int64_t n, const char *what) {
    const mdt_cache_branch *b = &c->br[c->cur];
    if (*p && *have != n)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: branch '%s' held %lld values of %s on this rank and now has "
                        "%lld: the shapes of a generation stay fixed (start a new one)",
                        b->name, (long long)*have, what, (long long)n);
    if (!*p) {
        if (!(*p = mdt_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1))))
            return MDT_FAIL(MDT_E_NOMEM, "cache: out of memory for %s", what);
        *have = n;
        c->bytes += (int64_t)sizeof(float) * n;
    }
    return MDT_OK;
}

mdt_status mdt_cache_head(mdt_cache *c, const mdt_dit *d, const float *in, const float *out,
                          int64_t n, int *skip) {
    mdt_cache_branch *b = &c->br[c->cur];
    *skip = 0;
    float *r = mdt_arena_floats(d->ar, n > 0 ? n : 1); // [n] this forward's residual
    if (!r)
        return MDT_E_NOMEM;
    for (int64_t i = 0; i < n; i++)
        r[i] = out[i] - in[i];
    /* the sums over this rank's rows, gathered over the CP group and added in chunk order */
    double sd = 0, sp = 0;
    const int have = b->prev_res != NULL;
    if (have) {
        if (b->n_res != n)
            return MDT_FAIL(MDT_E_INVALID,
                            "cache: branch '%s' held %lld values of the first block's residual "
                            "on this rank and now has %lld: the shapes of a generation stay fixed",
                            b->name, (long long)b->n_res, (long long)n);
        for (int64_t i = 0; i < n; i++) {
            const float e = r[i] - b->prev_res[i]; /* float, as torch subtracts */
            sd += fabs((double)e), sp += fabs((double)b->prev_res[i]);
        }
    }
    if (d->mesh && mdt_group_size(d->mesh, MDT_GROUP_CP) > 1) {
        const int P = mdt_group_size(d->mesh, MDT_GROUP_CP);
        int64_t *all = d->mesh->member_i64; /* [2][P] */
        int64_t v;
        memcpy(&v, &sd, sizeof v);
        MDT_TRY(mdt_allgather_i64(d->mesh, MDT_GROUP_CP, v, all));
        memcpy(&v, &sp, sizeof v);
        MDT_TRY(mdt_allgather_i64(d->mesh, MDT_GROUP_CP, v, all + P));
        sd = sp = 0;
        for (int i = 0; i < P; i++) {
            double x, y;
            memcpy(&x, &all[i], sizeof x), memcpy(&y, &all[P + i], sizeof y);
            sd += x, sp += y;
        }
    }
    if (have) {
        /* diffusers: (absmean / prev_absmean) > threshold computes; a NaN (0 / 0) skips */
        const double diff = sd / sp;
        c->last.diff = diff;
        *skip = !(diff > c->spec.threshold) && b->have_tail;
    }
    c->last.skipped = *skip;
    if (!*skip) {
        MDT_TRY(keep_buf(c, &b->prev_res, &b->n_res, n, "the first block's residual"));
        memcpy(b->prev_res, r, sizeof(float) * (size_t)n);
        b->have_tail = 0; /* until this forward's last block */
        c->flops_at_head = flops_now();
    } else {
        c->last.flops_saved = b->tail_flops;
    }
    return MDT_OK;
}

static int64_t rows_n(const mdt_dit *d, const mdt_cache_rows *s) {
    return d->B * s->rows * s->width;
}

/* f(dst row piece, src row piece, count) over every element's rows of stream s. */
static void each_row_block(const mdt_dit *d, const mdt_cache_rows *s, float *flat, int mode) {
    const int64_t w = s->rows * s->width;
    for (int64_t bb = 0; bb < d->B; bb++) {
        float *x = s->x + bb * s->ld, *f = flat + bb * w;
        if (mode == 0) /* keep */
            memcpy(f, x, sizeof(float) * (size_t)w);
        else if (mode == 1) /* apply: x = tail + x, as the hook adds */
            for (int64_t i = 0; i < w; i++)
                x[i] = f[i] + x[i];
        else /* tail: f = x - head (f holds head) */
            for (int64_t i = 0; i < w; i++)
                f[i] = x[i] - f[i];
    }
}

mdt_status mdt_cache_keep_head(mdt_cache *c, const mdt_dit *d, const mdt_cache_rows *s,
                               int nstreams) {
    mdt_cache_branch *b = &c->br[c->cur];
    if (nstreams > MDT_CACHE_STREAMS)
        return MDT_FAIL(MDT_E_INVALID, "cache: at most %d streams", MDT_CACHE_STREAMS);
    for (int k = 0; k < nstreams; k++) {
        MDT_TRY(keep_buf(c, &b->head[k], &b->n[k], rows_n(d, &s[k]), "a block's output"));
        each_row_block(d, &s[k], b->head[k], 0);
    }
    b->nstreams = nstreams;
    return MDT_OK;
}

mdt_status mdt_cache_apply(mdt_cache *c, const mdt_dit *d, const mdt_cache_rows *s, int nstreams) {
    mdt_cache_branch *b = &c->br[c->cur];
    if (nstreams != b->nstreams)
        return MDT_FAIL(MDT_E_INVALID, "cache: %d streams cached, %d given", b->nstreams, nstreams);
    for (int k = 0; k < nstreams; k++) {
        if (rows_n(d, &s[k]) != b->n[k])
            return MDT_FAIL(MDT_E_INVALID,
                            "cache: branch '%s' cached %lld values of stream %d on this rank, "
                            "the forward has %lld: the shapes of a generation stay fixed",
                            b->name, (long long)b->n[k], k, (long long)rows_n(d, &s[k]));
        each_row_block(d, &s[k], b->tail[k], 1);
    }
    return MDT_OK;
}

mdt_status mdt_cache_tail(mdt_cache *c, const mdt_dit *d, const mdt_cache_rows *s, int nstreams) {
    mdt_cache_branch *b = &c->br[c->cur];
    for (int k = 0; k < nstreams; k++) {
        int64_t have = b->tail[k] ? b->n[k] : 0;
        MDT_TRY(keep_buf(c, &b->tail[k], &have, b->n[k], "a tail residual"));
        if (rows_n(d, &s[k]) != b->n[k])
            return MDT_FAIL(MDT_E_INVALID, "cache: stream %d changed size within a forward", k);
        memcpy(b->tail[k], b->head[k], sizeof(float) * (size_t)b->n[k]);
        each_row_block(d, &s[k], b->tail[k], 2);
    }
    b->have_tail = 1;
    b->tail_flops = flops_now() - c->flops_at_head;
    return MDT_OK;
}

mdt_status mdt_cache_end(mdt_cache *c, int64_t blocks_run, int64_t blocks_skip) {
    c->last.blocks_run = blocks_run, c->last.blocks_skip = blocks_skip;
    c->in_forward = 0;
    if (c->nlog == c->caplog) {
        const int64_t cap = c->caplog ? 2 * c->caplog : 64;
        mdt_cache_step *p = realloc(c->log, sizeof *p * (size_t)cap);
        if (!p)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        c->log = p, c->caplog = cap;
    }
    c->log[c->nlog++] = c->last;
    return MDT_OK;
}
