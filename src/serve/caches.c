/*
 * caches.c — the step caches a server holds between forwards (serve.h): one generation's state
 * (models/cache.h) per "cache_generation" name a client sends, at most max of them, the least
 * recently used dropped first, and each dropped when unused for idle_ms. Every rank runs the
 * same requests with rank 0's clock, so every rank holds the same generations.
 */
#include "serve/serve.h"

#include "models/cache.h"

#include <stdlib.h>
#include <string.h>

mdt_status mdt_serve_caches_init(mdt_serve_caches *cs, int max, int64_t idle_ms) {
    memset(cs, 0, sizeof *cs);
    cs->max = max > 0 ? max : 1, cs->idle_ms = idle_ms;
    cs->e = calloc((size_t)cs->max, sizeof *cs->e);
    cs->gone = calloc(MDT_SERVE_CACHES_GONE, sizeof *cs->gone);
    return cs->e && cs->gone ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
}

static void drop(mdt_serve_caches *cs, int i) {
    /* remembered: a later forward of it is told, not given a fresh state silently */
    memcpy(cs->gone[cs->ngone++ % MDT_SERVE_CACHES_GONE], cs->e[i].gen, sizeof cs->e[i].gen);
    mdt_cache_free(cs->e[i].cache);
    cs->e[i] = cs->e[--cs->n];
    memset(&cs->e[cs->n], 0, sizeof cs->e[cs->n]);
}

void mdt_serve_caches_free(mdt_serve_caches *cs) {
    while (cs->n > 0)
        drop(cs, cs->n - 1);
    free(cs->e);
    free(cs->gone);
    memset(cs, 0, sizeof *cs);
}

int mdt_serve_caches_expire(mdt_serve_caches *cs, int64_t now_ms) {
    int n = 0;
    for (int i = cs->n - 1; cs->idle_ms > 0 && i >= 0; i--)
        if (now_ms - cs->e[i].last_ms > cs->idle_ms)
            drop(cs, i), n++;
    return n;
}

void mdt_serve_caches_end(mdt_serve_caches *cs, const char *gen) {
    for (int i = 0; i < cs->n; i++)
        if (strcmp(cs->e[i].gen, gen) == 0) {
            drop(cs, i);
            cs->gone[--cs->ngone % MDT_SERVE_CACHES_GONE][0] = '\0'; /* ended by its client */
            return;
        }
}

static const mdt_serve_cache *entry(const mdt_serve_caches *cs, const char *gen) {
    for (int i = 0; i < cs->n; i++)
        if (strcmp(cs->e[i].gen, gen) == 0)
            return &cs->e[i];
    return NULL;
}

struct mdt_cache *mdt_serve_caches_find(const mdt_serve_caches *cs, const char *gen) {
    const mdt_serve_cache *e = entry(cs, gen);
    return e ? e->cache : NULL;
}

int64_t mdt_serve_caches_serial_of(const mdt_serve_caches *cs, const char *gen) {
    const mdt_serve_cache *e = entry(cs, gen);
    return e ? e->serial : 0;
}

mdt_status mdt_serve_caches_use(mdt_serve_caches *cs, const mdt_serve_request *r,
                                struct mdt_cache **out) {
    *out = NULL;
    mdt_cache_spec sp;
    MDT_TRY(mdt_cache_spec_parse(r->cache, &sp));
    if (sp.kind == MDT_CACHE_OFF)
        return MDT_OK;
    mdt_serve_cache *e = NULL;
    for (int i = 0; i < cs->n && !e; i++)
        if (strcmp(cs->e[i].gen, r->cache_gen) == 0)
            e = &cs->e[i];
    if (e) {
        char had[256], now[256];
        mdt_cache_spec_str(&e->cache->spec, had, sizeof had);
        mdt_cache_spec_str(&sp, now, sizeof now);
        if (!mdt_cache_spec_equal(&e->cache->spec, &sp))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: cache generation '%s' runs %s, this forward asks for %s "
                            "(a new cache config starts a new generation)",
                            r->cache_gen, had, now);
    } else {
        for (int i = 0; i < MDT_SERVE_CACHES_GONE && i < cs->ngone; i++)
            if (strcmp(cs->gone[i], r->cache_gen) == 0)
                return MDT_FAIL(MDT_E_NOTFOUND,
                                "request: cache generation '%s' was dropped (unused for the "
                                "session idle time, or over the limit of %d generations): "
                                "start a new generation",
                                r->cache_gen, cs->max);
        if (cs->n == cs->max) { /* full: the least recently used generation goes */
            int lru = 0;
            for (int i = 1; i < cs->n; i++)
                lru = cs->e[i].last_ms < cs->e[lru].last_ms ? i : lru;
            drop(cs, lru);
        }
        e = &cs->e[cs->n];
        MDT_TRY(mdt_cache_create(&sp, &e->cache));
        strcpy(e->gen, r->cache_gen);
        e->serial = ++cs->made;
        cs->n++;
    }
    e->last_ms = r->now_ms;
    MDT_TRY(mdt_cache_select(e->cache, r->cache_context));
    *out = e->cache;
    return MDT_OK;
}
