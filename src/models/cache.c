/*
 * cache.c — the step caches of cache.h: the spec, a generation's branches, and each cache's
 * decision and kept state as diffusers' hooks compute them (first_block_cache.py, mag_cache.py,
 * taylorseer_cache.py), text_kv's kept K/V, and the three points a family's block loop calls.
 */
#define _POSIX_C_SOURCE 200809L
#include "models/cache.h"

#include "backend/backend.h"
#include "models/dit.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the spec ---- */

static mdt_status parse_double(const char *v, const char *key, double lo, double *out) {
    double x;
    if (!mdt_decimal(v, 0, &x) || x < lo)
        return MDT_FAIL(MDT_E_INVALID, "cache spec: %s=%.64s is not a number >= %g", key, v, lo);
    *out = x;
    return MDT_OK;
}

static mdt_status parse_int(const char *v, const char *key, int lo, int hi, int *out) {
    double x;
    if (!mdt_decimal(v, 1, &x) || x < lo || x > hi)
        return MDT_FAIL(MDT_E_INVALID, "cache spec: %s=%.64s is not an integer in [%d, %d]", key, v,
                        lo, hi);
    *out = (int)x;
    return MDT_OK;
}

/* mag_ratios=A/B/C...: the magnitude ratios, as float32 (diffusers keeps them in a float32
 * tensor) */
static mdt_status parse_ratios(char *v, mdt_cache_spec *out) {
    out->nratios = 0;
    for (char *t = v, *next; t; t = next) {
        next = strchr(t, '/');
        if (next)
            *next++ = '\0';
        double x;
        if (out->nratios == MDT_CACHE_RATIOS_MAX)
            return MDT_FAIL(MDT_E_INVALID, "cache spec: mag_ratios has more than %d values",
                            MDT_CACHE_RATIOS_MAX);
        MDT_TRY(parse_double(t, "mag_ratios", -1e30, &x));
        out->ratios[out->nratios++] = (float)x;
    }
    return MDT_OK;
}

/* diffusers' nearest_interp: the ratios to `n` values, src[round(i (len - 1) / (n - 1))] with the
 * product in float32 and torch's round (half to even) */
static void interp_ratios(mdt_cache_spec *sp, int n) {
    float src[MDT_CACHE_RATIOS_MAX];
    const int len = sp->nratios;
    memcpy(src, sp->ratios, sizeof(float) * (size_t)len);
    for (int i = 0; i < n; i++) {
        if (n == 1) {
            sp->ratios[0] = src[len - 1];
            break;
        }
        const float scale = (float)((double)(len - 1) / (double)(n - 1));
        const long k = lrintf((float)i * scale);
        sp->ratios[i] = src[k < 0 ? 0 : k >= len ? len - 1 : k];
    }
    sp->nratios = n;
}

mdt_status mdt_cache_spec_parse(const char *s, mdt_cache_spec *out) {
    memset(out, 0, sizeof *out);
    out->kind = MDT_CACHE_OFF;
    if (!s || !*s || strcmp(s, "none") == 0)
        return MDT_OK;
    const size_t len = strlen(s);
    if (len > MDT_CACHE_SPEC_MAX)
        return MDT_FAIL(MDT_E_INVALID, "cache spec: the spec is longer than %d bytes",
                        MDT_CACHE_SPEC_MAX);
    char *buf = malloc(len + 1);
    if (!buf)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    memcpy(buf, s, len + 1);
    mdt_status st = MDT_OK;
    char *args = strchr(buf, ':');
    if (args)
        *args++ = '\0';
    if (strcmp(buf, "first_block") == 0 || strcmp(buf, "fbc") == 0)
        out->kind = MDT_CACHE_FIRST_BLOCK, out->threshold = 0.05;
    else if (strcmp(buf, "mag") == 0 || strcmp(buf, "magcache") == 0)
        *out = (mdt_cache_spec){.kind = MDT_CACHE_MAG,
                                .threshold = 0.06,
                                .max_skip_steps = 3,
                                .retention_ratio = 0.2,
                                .num_inference_steps = 28};
    else if (strcmp(buf, "text_kv") == 0)
        out->kind = MDT_CACHE_TEXT_KV;
    else if (strcmp(buf, "taylorseer") == 0)
        out->kind = MDT_CACHE_TAYLOR, out->cache_interval = 5, out->disable_before = 3,
        out->disable_after = MDT_CACHE_NEVER, out->max_order = 1, out->factors_bf16 = 1;
    else
        st = MDT_FAIL(MDT_E_INVALID,
                      "cache spec: unknown cache '%.64s' (meshdit has first_block, mag, "
                      "taylorseer and text_kv: diffusers' FirstBlockCacheConfig, MagCacheConfig, "
                      "TaylorSeerCacheConfig, and the exact K/V of Wan's cross-attention)",
                      buf);
    const int mag = out->kind == MDT_CACHE_MAG, ts = out->kind == MDT_CACHE_TAYLOR;
    const char *seen[16];
    int nseen = 0;
    if (st == MDT_OK && args && !*args)
        st = MDT_FAIL(MDT_E_INVALID, "cache spec: '%.64s:' has nothing after the colon", buf);
    for (char *kv = st == MDT_OK ? args : NULL, *next; kv && st == MDT_OK; kv = next) {
        if ((next = strchr(kv, ',')))
            *next++ = '\0';
        char *v = strchr(kv, '=');
        if (!*kv) {
            st = MDT_FAIL(MDT_E_INVALID, "cache spec: an empty item between commas");
            break;
        }
        if (!v) {
            st = MDT_FAIL(MDT_E_INVALID, "cache spec: '%.64s' is not key=value", kv);
            break;
        }
        *v++ = '\0';
        for (int i = 0; i < nseen && st == MDT_OK; i++)
            if (strcmp(seen[i], kv) == 0)
                st = MDT_FAIL(MDT_E_INVALID, "cache spec: key '%.64s' is given twice", kv);
        if (st != MDT_OK)
            break;
        if (nseen < (int)(sizeof seen / sizeof seen[0]))
            seen[nseen++] = kv;
        if (out->kind == MDT_CACHE_TEXT_KV)
            st = MDT_FAIL(MDT_E_INVALID, "cache spec: text_kv takes no keys (got '%.64s')", kv);
        else if (ts && strcmp(kv, "cache_interval") == 0)
            st = parse_int(v, kv, 1, 1 << 20, &out->cache_interval);
        else if (ts && strcmp(kv, "disable_cache_before_step") == 0)
            st = parse_int(v, kv, -(1 << 20), 1 << 20, &out->disable_before);
        else if (ts && strcmp(kv, "disable_cache_after_step") == 0)
            st = strcmp(v, "none") == 0
                     ? (out->disable_after = MDT_CACHE_NEVER, MDT_OK)
                     : parse_int(v, kv, -(1 << 20), 1 << 20, &out->disable_after);
        else if (ts && strcmp(kv, "max_order") == 0)
            st = parse_int(v, kv, 0, MDT_TAYLOR_ORDERS, &out->max_order);
        else if (ts && strcmp(kv, "taylor_factors_dtype") == 0) {
            out->factors_bf16 = strcmp(v, "bfloat16") == 0;
            if (!out->factors_bf16 && strcmp(v, "float32") != 0)
                st = MDT_FAIL(MDT_E_INVALID,
                              "cache spec: taylor_factors_dtype=%.64s (bfloat16 or float32)", v);
        } else if (ts)
            st = MDT_FAIL(MDT_E_INVALID,
                          "cache spec: taylorseer has no key '%.64s' (it takes cache_interval, "
                          "disable_cache_before_step, disable_cache_after_step, max_order, "
                          "taylor_factors_dtype)",
                          kv);
        else if (strcmp(kv, "threshold") == 0)
            st = parse_double(v, kv, 0.0, &out->threshold);
        else if (mag && strcmp(kv, "max_skip_steps") == 0)
            st = parse_int(v, kv, 0, 1 << 20, &out->max_skip_steps);
        else if (mag && strcmp(kv, "retention_ratio") == 0)
            st = parse_double(v, kv, 0.0, &out->retention_ratio);
        else if (mag && strcmp(kv, "num_inference_steps") == 0)
            st = parse_int(v, kv, 1, MDT_CACHE_RATIOS_MAX, &out->num_inference_steps);
        else if (mag && strcmp(kv, "mag_ratios") == 0)
            st = parse_ratios(v, out);
        else
            st = MDT_FAIL(MDT_E_INVALID, "cache spec: %s has no key '%.64s' (it takes %s)",
                          mag ? "mag" : "first_block", kv,
                          mag ? "threshold, max_skip_steps, retention_ratio, num_inference_steps, "
                                "mag_ratios"
                              : "threshold");
    }
    if (st == MDT_OK && mag && out->nratios == 0)
        st = MDT_FAIL(MDT_E_INVALID,
                      "cache spec: mag needs mag_ratios=A/B/... (the model's magnitude ratios, as "
                      "diffusers' MagCacheConfig needs them; calibrating is not implemented)");
    if (st == MDT_OK && mag && out->nratios != out->num_inference_steps)
        interp_ratios(out, out->num_inference_steps);
    free(buf);
    return st;
}

mdt_status mdt_cache_spec_check(const char *spec, int *enabled) {
    mdt_cache_spec sp;
    *enabled = 0;
    if (spec && !*spec) /* a user's empty value: "none" says no cache */
        return MDT_FAIL(MDT_E_INVALID, "cache spec: empty (give a cache, or none for no cache)");
    MDT_TRY(mdt_cache_spec_parse(spec, &sp));
    *enabled = sp.kind != MDT_CACHE_OFF;
    return MDT_OK;
}

/* the shortest text that reads back as the same double */
static void num_str(double x, char *t, size_t cap) {
    snprintf(t, cap, "%.15g", x);
    if (strtod(t, NULL) != x)
        snprintf(t, cap, "%.17g", x);
}

void mdt_cache_spec_str(const mdt_cache_spec *sp, char *buf, size_t cap) {
    char t[32], r[32];
    num_str(sp->threshold, t, sizeof t);
    if (sp->kind == MDT_CACHE_FIRST_BLOCK)
        snprintf(buf, cap, "first_block:threshold=%s", t);
    else if (sp->kind == MDT_CACHE_TEXT_KV)
        snprintf(buf, cap, "text_kv");
    else if (sp->kind == MDT_CACHE_TAYLOR) {
        snprintf(r, sizeof r, "%d", sp->disable_after);
        snprintf(buf, cap,
                 "taylorseer:cache_interval=%d,disable_cache_before_step=%d,"
                 "disable_cache_after_step=%s,max_order=%d,taylor_factors_dtype=%s",
                 sp->cache_interval, sp->disable_before,
                 sp->disable_after == MDT_CACHE_NEVER ? "none" : r, sp->max_order,
                 sp->factors_bf16 ? "bfloat16" : "float32");
    } else if (sp->kind == MDT_CACHE_MAG) {
        num_str(sp->retention_ratio, r, sizeof r);
        snprintf(buf, cap,
                 "mag:threshold=%s,max_skip_steps=%d,retention_ratio=%s,num_inference_steps=%d "
                 "(%d mag_ratios)",
                 t, sp->max_skip_steps, r, sp->num_inference_steps, sp->nratios);
    } else
        snprintf(buf, cap, "none");
}

int mdt_cache_spec_text(const mdt_cache_spec *sp, char *buf, size_t cap) {
    if (sp->kind != MDT_CACHE_MAG) {
        mdt_cache_spec_str(sp, buf, cap);
        return 1;
    }
    /* MagCache's ratios, each the shortest decimal that reads back as the same float32 */
    size_t k = (size_t)snprintf(buf, cap, "mag:mag_ratios=");
    for (int i = 0; i < sp->nratios && k < cap; i++) {
        char t[32];
        for (int prec = 6; prec <= 9; prec++) {
            snprintf(t, sizeof t, "%.*g", prec, (double)sp->ratios[i]);
            if ((float)strtod(t, NULL) == sp->ratios[i])
                break;
        }
        k += (size_t)snprintf(buf + k, cap - k, "%s%s", i ? "/" : "", t);
    }
    char th[32], rr[32];
    num_str(sp->threshold, th, sizeof th);
    num_str(sp->retention_ratio, rr, sizeof rr);
    if (k < cap)
        k += (size_t)snprintf(buf + k, cap - k,
                              ",threshold=%s,max_skip_steps=%d,retention_ratio=%s,"
                              "num_inference_steps=%d",
                              th, sp->max_skip_steps, rr, sp->num_inference_steps);
    if (k < cap && k <= MDT_CACHE_SPEC_MAX)
        return 1;
    mdt_cache_spec_str(sp, buf, cap); /* a text --cache would refuse as too long: the short form */
    return 0;
}

int mdt_cache_spec_equal(const mdt_cache_spec *a, const mdt_cache_spec *b) {
    return a->kind == b->kind && a->threshold == b->threshold &&
           a->max_skip_steps == b->max_skip_steps && a->retention_ratio == b->retention_ratio &&
           a->num_inference_steps == b->num_inference_steps && a->nratios == b->nratios &&
           a->cache_interval == b->cache_interval && a->disable_before == b->disable_before &&
           a->disable_after == b->disable_after && a->max_order == b->max_order &&
           a->factors_bf16 == b->factors_bf16 &&
           memcmp(a->ratios, b->ratios, sizeof(float) * (size_t)a->nratios) == 0;
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
    for (int64_t i = 0; i < b->nts; i++)
        for (int k = 0; k <= MDT_TAYLOR_ORDERS; k++)
            mdt_free(b->ts[i].f[k]);
    free(b->ts);
    for (int64_t i = 0; i < b->nkv; i++)
        mdt_free(b->kv[i]);
    free(b->kv), free(b->kv_n);
    mdt_free(b->kv_ctx);
    mdt_free(b->prev_res);
    mdt_free(b->head), mdt_free(b->tail);
    char name[sizeof b->name];
    memcpy(name, b->name, sizeof name);
    memset(b, 0, sizeof *b);
    memcpy(b->name, name, sizeof name);
}

/* ---- tentative forwards ---- */

/* Frees x's buffers that `keep` does not hold at the same place, and x's pointer arrays (a
 * tentative branch's are its own copies): what one side of a tentative branch alone owns. */
static void free_unshared(mdt_cache_branch *x, const mdt_cache_branch *keep) {
    if (x->prev_res != keep->prev_res)
        mdt_free(x->prev_res);
    if (x->head != keep->head)
        mdt_free(x->head);
    if (x->tail != keep->tail)
        mdt_free(x->tail);
    if (x->kv_ctx != keep->kv_ctx)
        mdt_free(x->kv_ctx);
    for (int64_t i = 0; i < x->nkv; i++)
        if (i >= keep->nkv || x->kv[i] != keep->kv[i])
            mdt_free(x->kv[i]);
    for (int64_t i = 0; i < x->nts; i++)
        for (int k = 0; k <= MDT_TAYLOR_ORDERS; k++)
            if (i >= keep->nts || x->ts[i].f[k] != keep->ts[i].f[k])
                mdt_free(x->ts[i].f[k]);
    free(x->kv), free(x->kv_n), free(x->ts);
}

/* A copy of n elements of `size` bytes at p (NULL for none). */
static void *dup_array(const void *p, int64_t n, size_t size, int *ok) {
    if (!p || n <= 0)
        return NULL;
    void *q = malloc(size * (size_t)n);
    if (q)
        memcpy(q, p, size * (size_t)n);
    else
        *ok = 0;
    return q;
}

mdt_status mdt_cache_tentative(mdt_cache *c) {
    if (c->tent)
        return MDT_FAIL(MDT_E_INVALID, "cache: a tentative forward of branch '%s' is pending",
                        c->br[c->tent_branch].name);
    if (c->cur < 0)
        return MDT_FAIL(MDT_E_INVALID, "cache: no branch selected for this forward");
    mdt_cache_branch *b = &c->br[c->cur];
    int ok = 1;
    void *kv = dup_array(b->kv, b->nkv, sizeof *b->kv, &ok);
    void *kv_n = dup_array(b->kv_n, b->nkv, sizeof *b->kv_n, &ok);
    void *ts = dup_array(b->ts, b->nts, sizeof *b->ts, &ok);
    if (!ok) {
        free(kv), free(kv_n), free(ts);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    c->saved = *b; /* the originals stay with the saved state, the copies go on */
    b->kv = kv, b->kv_n = kv_n, b->ts = ts;
    c->saved_last = c->last, c->saved_nlog = c->nlog;
    c->tent = 1, c->tent_branch = c->cur;
    return MDT_OK;
}

void mdt_cache_commit(mdt_cache *c) {
    if (!c || !c->tent)
        return;
    free_unshared(&c->saved, &c->br[c->tent_branch]);
    memset(&c->saved, 0, sizeof c->saved);
    c->tent = 0;
}

void mdt_cache_rollback(mdt_cache *c) {
    if (!c || !c->tent)
        return;
    mdt_cache_branch *b = &c->br[c->tent_branch];
    free_unshared(b, &c->saved);
    *b = c->saved;
    memset(&c->saved, 0, sizeof c->saved);
    c->last = c->saved_last, c->nlog = c->saved_nlog;
    c->tent = 0;
}

/* The buffer *p of `bytes` is about to be written: in a tentative forward, one the saved state
 * still holds (`was`) is replaced by a fresh one first (with its bytes when `copy`: a write of
 * part of it). */
static mdt_status own_bytes(const mdt_cache *c, void **p, const void *was, size_t bytes, int copy) {
    if (!c->tent || !*p || *p != was)
        return MDT_OK;
    void *q = mdt_alloc(bytes > 0 ? bytes : 1);
    if (!q)
        return MDT_FAIL(MDT_E_NOMEM, "cache: out of memory for a tentative forward's state");
    if (copy)
        memcpy(q, *p, bytes);
    *p = q;
    return MDT_OK;
}

static mdt_status own_buf(const mdt_cache *c, float **p, const float *was, int64_t n, int copy) {
    void *q = *p;
    MDT_TRY(own_bytes(c, &q, was, sizeof(float) * (size_t)n, copy));
    *p = q;
    return MDT_OK;
}

/* *p is let go: freed unless the saved state of a tentative forward holds it (`was`). */
static void let_go(const mdt_cache *c, float **p, const float *was) {
    if (!(c->tent && *p == was))
        mdt_free(*p);
    *p = NULL;
}

void mdt_cache_free(mdt_cache *c) {
    if (!c)
        return;
    mdt_cache_rollback(c);
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
    b->acc_ratio = 1.0f, b->ts_step = -1, b->ts_last = -1;
    c->cur = c->nbranches++;
    return MDT_OK;
}

int mdt_cache_find(const mdt_cache *c, const char *branch) {
    for (int i = 0; i < c->nbranches; i++)
        if (strcmp(c->br[i].name, branch) == 0)
            return i;
    return -1;
}

int64_t mdt_cache_bytes(const mdt_cache *c) {
    int64_t n = 0;
    const int64_t fsz = (int64_t)sizeof(float);
    const int64_t esz = c->spec.factors_bf16 ? (int64_t)sizeof(uint16_t) : fsz;
    for (int i = 0; i < c->nbranches; i++) {
        const mdt_cache_branch *b = &c->br[i];
        n += (b->prev_res ? b->n_res : 0) * fsz;
        n += ((b->head != NULL) + (b->tail != NULL)) * b->n_out * fsz;
        n += (b->kv_ctx ? b->kv_nctx : 0) * fsz;
        for (int64_t k = 0; k < b->nkv; k++)
            n += b->kv[k] ? b->kv_n[k] * fsz : 0;
        for (int64_t k = 0; k < b->nts; k++)
            for (int o = 0; o <= MDT_TAYLOR_ORDERS; o++)
                n += b->ts[k].f[o] ? b->ts[k].n * esz : 0;
    }
    return n;
}

void mdt_cache_note_bytes(mdt_cache *c) {
    const int64_t n = mdt_cache_bytes(c);
    c->peak_bytes = n > c->peak_bytes ? n : c->peak_bytes;
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

int mdt_cache_on(const mdt_dit *d) {
    return d->m->cache && d->m->cache->spec.kind != MDT_CACHE_OFF;
}

mdt_status mdt_cache_begin(const mdt_dit *d, int supported, int64_t blocks, mdt_cache **out) {
    mdt_cache *c = d->m->cache;
    *out = NULL;
    if (!c || c->spec.kind == MDT_CACHE_OFF)
        return MDT_OK;
    static const char *const names[] = {"none", "first_block", "mag", "taylorseer", "text_kv"};
    if (!(supported & (1 << c->spec.kind)))
        return MDT_FAIL(MDT_E_UNSUPPORTED, "cache: %s is not implemented for %s (%s)",
                        names[c->spec.kind], d->m->fam->class_name,
                        c->spec.kind == MDT_CACHE_TAYLOR
                            ? "meshdit runs TaylorSeer on Flux and Qwen-Image, whose attention "
                              "modules diffusers' default patterns hook"
                        : c->spec.kind == MDT_CACHE_TEXT_KV
                            ? "only Wan attends a context through cross-attention; the joint "
                              "families' text K/V change with every block's text stream"
                            : "meshdit caches Flux, Qwen-Image and Wan, as diffusers' hooks do");
    if (blocks < 2)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: a step cache needs at least 2 transformer blocks (the model has "
                        "%lld)",
                        (long long)blocks);
    if (mdt_backend_mem())
        return MDT_FAIL(MDT_E_UNSUPPORTED, "cache: step caches run on the CPU backend only");
    if (c->cur < 0)
        return MDT_FAIL(MDT_E_INVALID, "cache: no branch selected for this forward");
    if (c->tent && c->cur != c->tent_branch)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: branch '%s' runs while a tentative forward of branch '%s' is "
                        "pending",
                        c->br[c->cur].name, c->br[c->tent_branch].name);
    c->in_forward = 1;
    c->last = (mdt_cache_step){.branch = c->cur, .diff = NAN};
    if (c->spec.kind == MDT_CACHE_TAYLOR) { /* the hook's _measure_should_compute */
        mdt_cache_branch *b = &c->br[c->cur];
        const mdt_cache_spec *sp = &c->spec;
        const int step = ++b->ts_step, k = step - sp->disable_before - 1;
        const int warmup = step < sp->disable_before;
        const int interval =
            ((k % sp->cache_interval) + sp->cache_interval) % sp->cache_interval == 0;
        const int cooldown = sp->disable_after != MDT_CACHE_NEVER && step >= sp->disable_after;
        c->ts_compute = warmup || interval || cooldown;
        if (!c->ts_compute && b->ts_last < 0) { /* refused: the branch stays at its step */
            b->ts_step--, c->in_forward = 0;
            return MDT_FAIL(MDT_E_INVALID,
                            "cache: TaylorSeer would predict step %d of branch '%s' before any "
                            "computed one (diffusers: \"Cannot predict without prior "
                            "initialization\"): disable_cache_before_step must be >= 1",
                            step, b->name);
        }
        c->last.skipped = !c->ts_compute;
        c->last.diff = c->ts_compute ? NAN : (double)(step - b->ts_last);
        c->flops_at_head = flops_now();
    }
    *out = c;
    return MDT_OK;
}

int mdt_cache_predicts(const mdt_cache *c) {
    return c && c->spec.kind == MDT_CACHE_TAYLOR && !c->ts_compute;
}

mdt_cache *mdt_cache_taylor_of(const mdt_dit *d) {
    mdt_cache *c = d->m->cache;
    return c && c->in_forward && c->spec.kind == MDT_CACHE_TAYLOR ? c : NULL;
}

/* Element e of factor k: float32, or bf16 bits widened. */
static float factor(const mdt_taylor_slot *t, int bf, int k, int64_t e) {
    return bf ? mdt_bf16_to_f32(((const uint16_t *)t->f[k])[e]) : ((const float *)t->f[k])[e];
}

mdt_status mdt_cache_taylor(mdt_cache *c, const mdt_dit *d, int64_t slot, int64_t b, float *x,
                            int64_t rows, int64_t width, int64_t ld) {
    mdt_cache_branch *br = &c->br[c->cur];
    const mdt_cache_spec *sp = &c->spec;
    const int64_t n = d->B * rows * width, w = rows * width;
    if (slot >= br->nts) {
        mdt_taylor_slot *p = realloc(br->ts, sizeof *p * (size_t)(slot + 1));
        if (!p)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        memset(p + br->nts, 0, sizeof *p * (size_t)(slot + 1 - br->nts));
        br->ts = p, br->nts = slot + 1;
    }
    mdt_taylor_slot *t = &br->ts[slot];
    if (t->n && t->n != n)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: branch '%s' held %lld values of an attention output on this rank "
                        "and now has %lld: the shapes of a generation stay fixed",
                        br->name, (long long)t->n, (long long)n);
    const int bf = sp->factors_bf16;
    const size_t esz = bf ? sizeof(uint16_t) : sizeof(float);
    if (!c->ts_compute) { /* predict: sum over orders of f_k offset^k / k!, in float32 */
        if (t->norders == 0)
            return MDT_FAIL(MDT_E_INVALID, "cache: TaylorSeer has no factors to predict from");
        const int off = br->ts_step - br->ts_last;
        float coeff[MDT_TAYLOR_ORDERS + 1];
        double fact = 1, pw = 1;
        for (int k = 0; k < t->norders; k++) { /* (offset ** k) / math.factorial(k) */
            coeff[k] = (float)(pw / fact);
            pw *= off, fact *= k + 1;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < width; i++) {
                const int64_t e = b * w + r * width + i;
                float o = 0.0f;
                for (int k = 0; k < t->norders; k++)
                    o = o + factor(t, bf, k, e) * coeff[k];
                x[r * ld + i] = o;
            }
        return MDT_OK;
    }
    /* update: f_0 = x; f_{j+1} = (f_j(new) - f_j(kept)) / (step - last), while f_j is kept */
    const int have = br->ts_last < 0 ? 0 : t->norders;
    const int nn = have + 1 < sp->max_order + 1 ? have + 1 : sp->max_order + 1;
    for (int k = 0; k < nn; k++)
        if (!t->f[k]) {
            if (!(t->f[k] = mdt_alloc(esz * (size_t)(n > 0 ? n : 1))))
                return MDT_FAIL(MDT_E_NOMEM, "cache: out of memory for TaylorSeer's factors");
        }
    for (int k = 0; k < nn; k++) /* written in part (batch element b): kept values copied */
        MDT_TRY(own_bytes(c, &t->f[k], slot < c->saved.nts ? c->saved.ts[slot].f[k] : NULL,
                          esz * (size_t)n, 1));
    t->n = n;
    const float delta = (float)(br->ts_step - br->ts_last);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) {
            const int64_t e = b * w + r * width + i;
            float nf = x[r * ld + i]; /* new_factors[j], float32 */
            for (int k = 0; k < nn; k++) {
                const float next = k + 1 < nn ? (nf - factor(t, bf, k, e)) / delta : 0.0f;
                if (bf) /* kept as bf16, as diffusers keeps them (taylor_factors_dtype) */
                    ((uint16_t *)t->f[k])[e] = mdt_f32_to_bf16(nf);
                else
                    ((float *)t->f[k])[e] = nf;
                nf = next;
            }
        }
    t->updated = nn;
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
    }
    return MDT_OK;
}

static int64_t rows_n(const mdt_dit *d, const mdt_cache_rows *s) {
    return d->B * s->rows * s->width;
}

/* First-Block Cache after the first block: in, out [n] this rank's rows of the hidden stream
 * before and after it; the shared statistic (collective over the CP group) sets *skip, and a
 * forward that computes keeps the residual. */
static mdt_status fbc_decide(mdt_cache *c, const mdt_dit *d, const float *in, const float *out,
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
        MDT_TRY(own_buf(c, &b->prev_res, c->saved.prev_res, n, 0));
        memcpy(b->prev_res, r, sizeof(float) * (size_t)n);
        b->have_tail = 0; /* until this forward's last block */
        c->flops_at_head = flops_now();
    } else {
        c->last.flops_saved = b->tail_flops;
    }
    return MDT_OK;
}

/* Over every element's rows of s and the branch's dense [B, rows, width] buffer f: keep (f = s),
 * apply (s = f + s, as the hook adds the tail) or tail (f = s - f, f holding the head). */
enum { ROWS_KEEP, ROWS_APPLY, ROWS_TAIL };
static void each_row_block(const mdt_dit *d, const mdt_cache_rows *s, float *flat, int mode) {
    const int64_t w = s->rows * s->width;
    for (int64_t bb = 0; bb < d->B; bb++) {
        float *x = s->x + bb * s->ld, *f = flat + bb * w;
        if (mode == ROWS_KEEP)
            memcpy(f, x, sizeof(float) * (size_t)w);
        else if (mode == ROWS_APPLY)
            for (int64_t i = 0; i < w; i++)
                x[i] = f[i] + x[i];
        else
            for (int64_t i = 0; i < w; i++)
                f[i] = x[i] - f[i];
    }
}

/* ---- MagCache (diffusers' hooks/mag_cache.py) ---- */

/* Decides this forward (*skip: no block runs) from the schedule alone. */
static mdt_status mag_decide(mdt_cache *c, int *skip) {
    mdt_cache_branch *b = &c->br[c->cur];
    const mdt_cache_spec *sp = &c->spec;
    const int cur = b->step_index;
    const float scale = cur >= sp->nratios ? 1.0f : sp->ratios[cur];
    /* the hook's int(retention_ratio * steps + 0.5), in double: a ratio past the schedule (or
     * one too large for an int) means no step is ever skipped */
    const double retention = floor(sp->retention_ratio * sp->num_inference_steps + 0.5);
    int compute = 1;
    c->last.diff = NAN;
    if ((double)cur >= retention) { /* float32, as the hook's tensors compute it */
        b->acc_ratio *= scale;
        b->acc_steps++;
        b->acc_err += fabsf(1.0f - b->acc_ratio);
        c->last.diff = b->acc_err;
        if (b->prev_res && b->acc_err <= (float)sp->threshold && b->acc_steps <= sp->max_skip_steps)
            compute = 0;
        else
            b->acc_ratio = 1.0f, b->acc_steps = 0, b->acc_err = 0.0f;
    }
    *skip = !compute;
    c->last.skipped = *skip;
    if (*skip)
        c->last.flops_saved = b->tail_flops;
    else
        c->flops_at_head = flops_now();
    return MDT_OK;
}

/* The hook's _advance_step: past the schedule's last step, a fresh state. */
static void mag_advance(mdt_cache *c, mdt_cache_branch *b) {
    if (++b->step_index < c->spec.num_inference_steps)
        return;
    mdt_cache_note_bytes(c); /* what the schedule held, before it lets go */
    b->step_index = 0, b->acc_ratio = 1.0f, b->acc_steps = 0, b->acc_err = 0.0f;
    if (b->prev_res) {
        let_go(c, &b->prev_res, c->saved.prev_res);
        b->n_res = 0;
    }
}

/* Skipping: s (the first block's input) += the kept residual; the step advances. */
static mdt_status mag_apply(mdt_cache *c, const mdt_dit *d, const mdt_cache_rows *s) {
    mdt_cache_branch *b = &c->br[c->cur];
    if (rows_n(d, s) != b->n_res)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: branch '%s' kept %lld values of the residual on this rank, the "
                        "forward has %lld: the shapes of a generation stay fixed",
                        b->name, (long long)b->n_res, (long long)rows_n(d, s));
    const int64_t w = s->rows * s->width;
    for (int64_t bb = 0; bb < d->B; bb++) { /* output = hidden_states + residual */
        float *x = s->x + bb * s->ld;
        const float *r = b->prev_res + bb * w;
        for (int64_t i = 0; i < w; i++)
            x[i] = x[i] + r[i];
    }
    mag_advance(c, b);
    return MDT_OK;
}

/* Computing, after the last block: the residual out - in (in dense, out a view) kept; the step
 * advances. */
static mdt_status mag_keep(mdt_cache *c, const mdt_dit *d, const float *in,
                           const mdt_cache_rows *out) {
    mdt_cache_branch *b = &c->br[c->cur];
    const int64_t n = rows_n(d, out), w = out->rows * out->width;
    MDT_TRY(keep_buf(c, &b->prev_res, &b->n_res, n, "the residual"));
    MDT_TRY(own_buf(c, &b->prev_res, c->saved.prev_res, n, 0));
    for (int64_t bb = 0; bb < d->B; bb++) {
        const float *x = out->x + bb * out->ld, *x0 = in + bb * w;
        float *r = b->prev_res + bb * w;
        for (int64_t i = 0; i < w; i++)
            r[i] = x[i] - x0[i];
    }
    b->tail_flops = flops_now() - c->flops_at_head;
    mag_advance(c, b);
    return MDT_OK;
}

/* ---- text_kv ---- */

mdt_cache *mdt_cache_kv_of(const mdt_dit *d) {
    mdt_cache *c = d->m->cache;
    return c && c->in_forward && c->spec.kind == MDT_CACHE_TEXT_KV ? c : NULL;
}

mdt_status mdt_cache_kv_context(mdt_cache *c, const mdt_dit *d, const float *txt, int64_t nt,
                                const float *img, int64_t ni) {
    mdt_cache_branch *b = &c->br[c->cur];
    const int64_t n = nt + ni;
    int64_t same = b->kv_ctx && b->kv_nctx == n &&
                   memcmp(b->kv_ctx, txt, sizeof(float) * (size_t)nt) == 0 &&
                   (ni == 0 || memcmp(b->kv_ctx + nt, img, sizeof(float) * (size_t)ni) == 0);
    /* every rank must take the same path: its collectives (the K norm's TP all-reduce) follow */
    for (int g = 0; d->mesh && g < 2; g++) {
        const mdt_group grp = g ? MDT_GROUP_CP : MDT_GROUP_TP;
        const int P = mdt_group_size(d->mesh, grp);
        if (P < 2)
            continue;
        int64_t *all = d->mesh->member_i64;
        MDT_TRY(mdt_allgather_i64(d->mesh, grp, same, all));
        for (int i = 0; i < P; i++)
            same = same && all[i];
    }
    b->kv_valid = (int)same;
    c->last.skipped = (int)same;
    if (same)
        return MDT_OK;
    if (b->kv_nctx != n) {
        let_go(c, &b->kv_ctx, c->saved.kv_ctx);
        b->kv_nctx = 0;
        if (!(b->kv_ctx = mdt_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1))))
            return MDT_FAIL(MDT_E_NOMEM, "cache: out of memory for the context");
        b->kv_nctx = n;
    }
    MDT_TRY(own_buf(c, &b->kv_ctx, c->saved.kv_ctx, n, 0));
    memcpy(b->kv_ctx, txt, sizeof(float) * (size_t)nt); /* [text | image] */
    if (ni)
        memcpy(b->kv_ctx + nt, img, sizeof(float) * (size_t)ni);
    return MDT_OK;
}

mdt_status mdt_cache_kv_slot(mdt_cache *c, int64_t slot, int64_t n, float **buf, int *valid) {
    mdt_cache_branch *b = &c->br[c->cur];
    if (slot >= b->nkv) {
        float **p = realloc(b->kv, sizeof *p * (size_t)(slot + 1));
        if (p)
            b->kv = p;
        int64_t *q = p ? realloc(b->kv_n, sizeof *q * (size_t)(slot + 1)) : NULL;
        if (!p || !q)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        b->kv_n = q;
        for (int64_t i = b->nkv; i <= slot; i++)
            b->kv[i] = NULL, b->kv_n[i] = 0;
        b->nkv = slot + 1;
    }
    const float *was = slot < c->saved.nkv ? c->saved.kv[slot] : NULL;
    if (b->kv[slot] && b->kv_n[slot] != n) { /* a new context of another length */
        let_go(c, &b->kv[slot], was);
        if (b->kv_valid)
            return MDT_FAIL(MDT_E_INVALID, "cache: text_kv slot %lld changed size",
                            (long long)slot);
    }
    if (!b->kv[slot]) {
        if (!(b->kv[slot] = mdt_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1))))
            return MDT_FAIL(MDT_E_NOMEM, "cache: out of memory for the kept K/V");
        b->kv_n[slot] = n;
    }
    if (!b->kv_valid) /* the caller computes into it */
        MDT_TRY(own_buf(c, &b->kv[slot], was, n, 0));
    *buf = b->kv[slot];
    *valid = b->kv_valid;
    return MDT_OK;
}

/* ---- the block loop's points ---- */

/* The forward's record: its blocks run and skipped; TaylorSeer's factors committed. */
static mdt_status cache_end(mdt_cache *c, int64_t blocks_run, int64_t blocks_skip);

mdt_status mdt_cache_pre(mdt_cache *c, const mdt_dit *d, const mdt_cache_rows *hidden, float **x0,
                         int *skip) {
    *x0 = NULL, *skip = 0;
    if (!c || c->spec.kind == MDT_CACHE_TAYLOR || c->spec.kind == MDT_CACHE_TEXT_KV)
        /* TaylorSeer and text_kv work inside the blocks */
        return MDT_OK;
    const int64_t n = rows_n(d, hidden), w = hidden->rows * hidden->width;
    if (!(*x0 = mdt_arena_floats(d->ar, n > 0 ? n : 1))) // [B, rows, width] block 0's input
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < d->B; b++)
        memcpy(*x0 + b * w, hidden->x + b * hidden->ld, sizeof(float) * (size_t)w);
    if (c->spec.kind != MDT_CACHE_MAG)
        return MDT_OK;
    MDT_TRY(mag_decide(c, skip));
    return *skip ? mag_apply(c, d, hidden) : MDT_OK;
}

mdt_status mdt_cache_after_first(mdt_cache *c, const mdt_dit *d, const float *x0,
                                 const mdt_cache_rows *hidden, int *skip) {
    if (!c || c->spec.kind != MDT_CACHE_FIRST_BLOCK)
        return MDT_OK;
    mdt_cache_branch *b = &c->br[c->cur];
    const int64_t n = rows_n(d, hidden);
    MDT_TRY(fbc_decide(c, d, x0, hidden->x, n, skip));
    if (!*skip) { /* computing: the first block's output, for this forward's tail */
        MDT_TRY(keep_buf(c, &b->head, &b->n_out, n, "the first block's output"));
        MDT_TRY(own_buf(c, &b->head, c->saved.head, n, 0));
        each_row_block(d, hidden, b->head, ROWS_KEEP);
        return MDT_OK;
    }
    if (n != b->n_out)
        return MDT_FAIL(MDT_E_INVALID,
                        "cache: branch '%s' cached %lld values of the hidden stream on this rank, "
                        "the forward has %lld: the shapes of a generation stay fixed",
                        b->name, (long long)b->n_out, (long long)n);
    each_row_block(d, hidden, b->tail, ROWS_APPLY);
    return MDT_OK;
}

mdt_status mdt_cache_post(mdt_cache *c, const mdt_dit *d, const float *x0,
                          const mdt_cache_rows *out, int skip, int64_t ran, int64_t blocks) {
    if (!c)
        return MDT_OK;
    if (!skip && c->spec.kind == MDT_CACHE_FIRST_BLOCK) { /* the tail residual: out - head */
        mdt_cache_branch *b = &c->br[c->cur];
        int64_t have = b->tail ? b->n_out : 0;
        if (rows_n(d, out) != b->n_out)
            return MDT_FAIL(MDT_E_INVALID, "cache: the hidden stream changed size in a forward");
        MDT_TRY(keep_buf(c, &b->tail, &have, b->n_out, "the tail residual"));
        MDT_TRY(own_buf(c, &b->tail, c->saved.tail, b->n_out, 0));
        memcpy(b->tail, b->head, sizeof(float) * (size_t)b->n_out);
        each_row_block(d, out, b->tail, ROWS_TAIL);
        b->have_tail = 1;
        b->tail_flops = flops_now() - c->flops_at_head;
    }
    if (!skip && c->spec.kind == MDT_CACHE_MAG)
        MDT_TRY(mag_keep(c, d, x0, out));
    return cache_end(c, ran, blocks - ran);
}

static mdt_status cache_end(mdt_cache *c, int64_t blocks_run, int64_t blocks_skip) {
    c->last.blocks_run = blocks_run, c->last.blocks_skip = blocks_skip;
    if (c->spec.kind == MDT_CACHE_TAYLOR) {
        mdt_cache_branch *b = &c->br[c->cur];
        if (c->ts_compute) { /* the factors' orders, then last_update_step = current_step */
            for (int64_t i = 0; i < b->nts; i++)
                if (b->ts[i].updated)
                    b->ts[i].norders = b->ts[i].updated, b->ts[i].updated = 0;
            b->ts_last = b->ts_step;
            b->tail_flops = flops_now() - c->flops_at_head;
        } else { /* saved: a full forward's FLOPs less this one's (the MLPs still ran) */
            const double spent = flops_now() - c->flops_at_head;
            c->last.flops_saved = b->tail_flops > spent ? b->tail_flops - spent : 0;
        }
    }
    c->in_forward = 0;
    mdt_cache_note_bytes(c);
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
