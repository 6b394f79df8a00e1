/*
 * core.c — implementation of the status/message, log, allocator, arena, timer and counters of
 * core.h. Single-threaded use per rank except the error message, which is thread-local; the
 * memory counters use relaxed atomics so kernels may allocate from worker threads.
 */
#define _POSIX_C_SOURCE 200809L
#include "core.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

static _Thread_local char tl_msg[2048];
static _Thread_local char tl_where[128];

const char *mdt_status_str(mdt_status s) {
    switch (s) {
    case MDT_OK: return "MDT_OK";
    case MDT_E_INVALID: return "MDT_E_INVALID";
    case MDT_E_IO: return "MDT_E_IO";
    case MDT_E_FORMAT: return "MDT_E_FORMAT";
    case MDT_E_NOMEM: return "MDT_E_NOMEM";
    case MDT_E_MPI: return "MDT_E_MPI";
    case MDT_E_UNSUPPORTED: return "MDT_E_UNSUPPORTED";
    case MDT_E_NOTFOUND: return "MDT_E_NOTFOUND";
    case MDT_E_NUMERIC: return "MDT_E_NUMERIC";
    case MDT_E_STOPPED: return "MDT_E_STOPPED";
    }
    return "MDT_E_UNKNOWN";
}

const char *mdt_last_error(void) { return tl_msg; }
const char *mdt_last_error_where(void) { return tl_where; }
void mdt_error_clear(void) { tl_msg[0] = 0, tl_where[0] = 0; }

/* A message longer than the buffer keeps its start and its end, the middle cut to " ... ": a
 * long path (a message's usual start) must not push out the cause (its usual end). Cuts fall
 * on UTF-8 character boundaries. */
void mdt_fit_text(const char *full, char *buf, size_t cap) {
    const size_t n = strlen(full);
    if (cap < 16 || n < cap) {
        snprintf(buf, cap, "%s", full);
        return;
    }
    size_t head = cap / 3, tail = n - (cap - 1 - head - 5);
    while (head > 0 && ((unsigned char)full[head] & 0xc0u) == 0x80u)
        head--;
    while (tail < n && ((unsigned char)full[tail] & 0xc0u) == 0x80u)
        tail++;
    snprintf(buf, cap, "%.*s ... %s", (int)head, full, full + tail);
}

static void set_msg(const char *full) { mdt_fit_text(full, tl_msg, sizeof tl_msg); }

/* The message of fmt and ap as this thread's last error, made at file:line. */
static void fail_v(const char *file, int line, const char *fmt, va_list ap) {
    const char *base = strrchr(file, '/');
    char full[4 * sizeof tl_msg + 8192]; /* room for two paths of PATH_MAX and the words */
    vsnprintf(full, sizeof full, fmt, ap);
    set_msg(full);
    snprintf(tl_where, sizeof tl_where, "%s:%d", base ? base + 1 : file, line);
}

void mdt_fail_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(file, line, fmt, ap);
    va_end(ap);
}

mdt_status mdt_fail_prefix(mdt_status code, const char *fmt, ...) {
    char full[4 * sizeof tl_msg + 8192];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(full, sizeof full, fmt, ap);
    va_end(ap);
    if (k >= 0 && (size_t)k < sizeof full)
        snprintf(full + k, sizeof full - (size_t)k, ": %s", tl_msg);
    set_msg(full);
    return code;
}

/* ---- escaping strings from files for messages ---- */
/* Length of the well-formed UTF-8 sequence at s (2..4) and its code point, or 0 if there is none
 * (stray continuation, overlong form, surrogate, beyond U+10FFFF, cut short). */
static int utf8_seq(const unsigned char *s, uint32_t *cp) {
    const unsigned char c = s[0];
    int len;
    uint32_t v, lo = 0x80, hi = 0xbf; /* the allowed range of the second byte */
    if (c >= 0xc2 && c <= 0xdf)
        len = 2, v = c & 0x1fu;
    else if (c >= 0xe0 && c <= 0xef)
        len = 3, v = c & 0x0fu, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
    else if (c >= 0xf0 && c <= 0xf4)
        len = 4, v = c & 0x07u, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
    else
        return 0;
    for (int i = 1; i < len; i++) {
        if (s[i] < (i == 1 ? lo : 0x80) || s[i] > (i == 1 ? hi : 0xbf))
            return 0; /* also stops at the terminating NUL */
        v = (v << 6) | (s[i] & 0x3fu);
    }
    *cp = v;
    return len;
}

/* Code points a terminal acts on rather than shows: C1 controls, line/paragraph separators,
 * bidirectional marks, embeddings, overrides and isolates. */
static int cp_is_control(uint32_t cp) {
    return (cp >= 0x80 && cp <= 0x9f) || cp == 0x61c || cp == 0x200e || cp == 0x200f ||
           (cp >= 0x2028 && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

int mdt_decimal(const char *s, int ints, double *out) {
    const char *p = s + (*s == '-');
    int digits = 0;
    for (; *p >= '0' && *p <= '9'; p++)
        digits++;
    if (!ints && *p == '.')
        for (p++; *p >= '0' && *p <= '9'; p++)
            digits++;
    if (!digits)
        return 0;
    if (!ints && (*p == 'e' || *p == 'E')) {
        p += p[1] == '-' || p[1] == '+' ? 2 : 1;
        if (!(*p >= '0' && *p <= '9'))
            return 0;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    if (*p)
        return 0;
    const double v = strtod(s, NULL);
    if (!isfinite(v))
        return 0;
    int nonzero = 0; /* a mantissa digit other than 0: a number that must not read as 0 */
    for (const char *q = s; *q && *q != 'e' && *q != 'E'; q++)
        nonzero |= *q >= '1' && *q <= '9';
    if (nonzero && v == 0) /* 1e-400: below the smallest double, not a number to use */
        return 0;
    *out = v;
    return 1;
}

static const char *escape(const char *s, char *buf, size_t n, int backslash);

const char *mdt_escape(const char *s, char *buf, size_t n) { return escape(s, buf, n, 1); }

const char *mdt_escape_line(const char *s, char *buf, size_t n) { return escape(s, buf, n, 0); }

static const char *escape(const char *s, char *buf, size_t n, int backslash) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)(s ? s : "(null)");
    size_t len = 0, safe = 0; /* safe: the longest prefix that still leaves room for "..." */
    if (n < 8) {
        if (n)
            buf[0] = 0;
        return buf;
    }
    while (*p) {
        char piece[16];
        size_t k = 0;
        uint32_t cp = 0;
        int seq = *p >= 0x80 ? utf8_seq(p, &cp) : 0;
        if (*p >= 0x20 && *p < 0x7f && (*p != '\\' || !backslash)) {
            piece[k++] = (char)*p++;
        } else if (seq && !cp_is_control(cp)) {
            for (int i = 0; i < seq; i++)
                piece[k++] = (char)*p++;
        } else {
            for (int i = 0; i < (seq ? seq : 1); i++, p++) {
                piece[k++] = '\\', piece[k++] = 'x';
                piece[k++] = hex[*p >> 4], piece[k++] = hex[*p & 15u];
            }
        }
        if (len + k > n - 1) { /* does not fit: cut at the last boundary with room for "..." */
            memcpy(buf + safe, "...", 4);
            return buf;
        }
        memcpy(buf + len, piece, k);
        len += k;
        if (len + 3 <= n - 1)
            safe = len;
    }
    buf[len] = 0;
    return buf;
}

/* ---- log ---- */
static mdt_log_level g_level = MDT_LOG_WARN;
static int g_rank = -1;
void mdt_log_set_level(mdt_log_level lvl) { g_level = lvl; }
void mdt_log_set_rank(int rank) { g_rank = rank; }
void mdt_log(mdt_log_level lvl, const char *fmt, ...) {
    static const char *names[] = {"error", "warning", "info", "debug"};
    char buf[2048];
    va_list ap;
    if (lvl > g_level)
        return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (g_rank >= 0)
        fprintf(stderr, "meshdit[%d]: %s: %s\n", g_rank, names[lvl], buf);
    else
        fprintf(stderr, "meshdit: %s: %s\n", names[lvl], buf);
}

/* ---- allocator: a 64-byte header before each block records its size, and how far the header
 * sits past the C library's block: 0, except after an mdt_realloc that the library moved to a
 * place of its own (16-byte) alignment ---- */
static _Atomic int64_t g_live, g_peak, g_count;
enum { HDR = 64 };

static void count_alloc(int64_t nbytes) {
    int64_t live = atomic_fetch_add_explicit(&g_live, nbytes, memory_order_relaxed) + nbytes;
    int64_t peak = atomic_load_explicit(&g_peak, memory_order_relaxed);
    while (live > peak && !atomic_compare_exchange_weak_explicit(
                              &g_peak, &peak, live, memory_order_relaxed, memory_order_relaxed)) {
    }
}

void *mdt_alloc(size_t nbytes) {
    void *raw = NULL;
    if (nbytes > (size_t)INT64_MAX - HDR || posix_memalign(&raw, HDR, nbytes + HDR) != 0)
        return NULL;
    ((int64_t *)raw)[0] = (int64_t)nbytes, ((int64_t *)raw)[1] = 0;
    count_alloc((int64_t)nbytes);
    atomic_fetch_add_explicit(&g_count, 1, memory_order_relaxed);
    return (char *)raw + HDR;
}

void *mdt_calloc(size_t nbytes) {
    void *p = mdt_alloc(nbytes);
    if (p)
        memset(p, 0, nbytes);
    return p;
}

/* realloc keeps large blocks where they are or remaps their pages (no copy: a 2 GiB request
 * grown as it arrives never costs twice its size); the block asked for has HDR bytes to spare,
 * so that a block the library moved to a less aligned place is realigned within it. */
void *mdt_realloc(void *p, size_t nbytes) {
    if (!p)
        return mdt_alloc(nbytes);
    if (nbytes > (size_t)INT64_MAX - 2 * HDR)
        return NULL;
    char *raw = (char *)p - HDR;
    const int64_t old = ((int64_t *)raw)[0], shift = ((int64_t *)raw)[1];
    char *base = realloc(raw - shift, nbytes + 2 * HDR);
    if (!base)
        return NULL;
    const int64_t nshift = (int64_t)((HDR - (uintptr_t)base % HDR) % HDR);
    const int64_t keep = old < (int64_t)nbytes ? old : (int64_t)nbytes;
    if (nshift != shift)
        memmove(base + nshift, base + shift, (size_t)(HDR + keep));
    raw = base + nshift;
    ((int64_t *)raw)[0] = (int64_t)nbytes, ((int64_t *)raw)[1] = nshift;
    count_alloc((int64_t)nbytes - old);
    atomic_fetch_add_explicit(&g_count, 1, memory_order_relaxed);
    return raw + HDR;
}

void mdt_free(void *p) {
    if (!p)
        return;
    char *raw = (char *)p - HDR;
    atomic_fetch_sub_explicit(&g_live, ((int64_t *)raw)[0], memory_order_relaxed);
    free(raw - ((int64_t *)raw)[1]);
}

int64_t mdt_mem_live(void) { return atomic_load(&g_live); }
int64_t mdt_mem_peak(void) { return atomic_load(&g_peak); }
void mdt_mem_reset_peak(void) { atomic_store(&g_peak, atomic_load(&g_live)); }
int64_t mdt_mem_alloc_count(void) { return atomic_load(&g_count); }

/* ---- device memory hooks ---- */
static const mdt_mem_source *g_device_mem;
const mdt_mem_source *mdt_mem_device(void) { return g_device_mem; }
void mdt_mem_set_device(const mdt_mem_source *src) { g_device_mem = src; }

/* ---- arena ---- */
struct mdt_arena_chunk {
    struct mdt_arena_chunk *next;
    size_t cap;
    char *data;
};

void mdt_arena_init(mdt_arena *a) { memset(a, 0, sizeof *a); }

static struct mdt_arena_chunk *chunk_new(const mdt_arena *a, size_t cap) {
    struct mdt_arena_chunk *c = mdt_alloc(sizeof *c);
    if (!c)
        return NULL;
    c->data = a->src ? a->src->alloc(cap) : mdt_alloc(cap);
    if (!c->data) {
        mdt_free(c);
        return NULL;
    }
    c->cap = cap, c->next = NULL;
    return c;
}

float *mdt_arena_floats(mdt_arena *a, int64_t n) {
    size_t need = ((size_t)(n > 0 ? n : 1) * sizeof(float) + 63u) & ~(size_t)63u;
    if (!a->cur) {
        a->cur = a->chunks;
        a->used = 0;
    }
    while (a->cur && a->used + need > a->cur->cap) {
        if (!a->cur->next) {
            size_t cap = need > ((size_t)1 << 20) ? need : ((size_t)1 << 20);
            struct mdt_arena_chunk *c = chunk_new(a, cap);
            if (!c) {
                (void)MDT_FAIL(MDT_E_NOMEM, "out of %s memory allocating %zu activation bytes",
                               a->src ? a->src->what : "host", cap);
                return NULL;
            }
            a->cur->next = c;
        }
        a->cur = a->cur->next;
        a->used = 0;
    }
    if (!a->cur) { /* empty arena */
        size_t cap = need > ((size_t)1 << 20) ? need : ((size_t)1 << 20);
        a->chunks = a->cur = chunk_new(a, cap);
        a->used = 0;
        if (!a->cur) {
            (void)MDT_FAIL(MDT_E_NOMEM, "out of %s memory allocating %zu activation bytes",
                           a->src ? a->src->what : "host", cap);
            return NULL;
        }
    }
    float *p = (float *)(void *)(a->cur->data + a->used);
    a->used += need;
    a->in_use += (int64_t)need;
    if (a->in_use > a->high_water)
        a->high_water = a->in_use;
    return p;
}

mdt_arena_mark mdt_arena_mark_get(const mdt_arena *a) {
    mdt_arena_mark mk = {a->cur, a->used, a->in_use};
    return mk;
}

void mdt_arena_rewind(mdt_arena *a, mdt_arena_mark mk) {
    a->cur = mk.chunk;
    a->used = mk.used;
    a->in_use = mk.in_use;
}

mdt_status mdt_arena_reset(mdt_arena *a) {
    size_t held = 0;
    for (const struct mdt_arena_chunk *c = a->chunks; c; c = c->next)
        held += c->cap;
    /* Several chunks (a first step grew the arena) are kept while they hold at most twice the
     * high-water mark: their pages are already touched, and the same steps again allocate
     * nothing. Merging them into one fresh chunk made the second step fault every page of it
     * again (ulysses2 on the medium Flux: 12k faults, 1.43-1.46 s against 1.15; docs/perf.md).
     * Past twice the mark (steps whose shapes vary, a server's requests, grew the chain) they
     * are replaced by one chunk of the high-water size, so what an arena holds stays bounded. */
    if (a->chunks && a->chunks->next && held > 2 * (size_t)a->high_water) {
        mdt_arena_release(a);
        struct mdt_arena_chunk *c = chunk_new(a, (size_t)a->high_water);
        if (!c)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory allocating %lld activation bytes",
                            (long long)a->high_water);
        a->chunks = c;
    }
    a->cur = NULL;
    a->used = 0;
    a->in_use = 0;
    return MDT_OK;
}

void mdt_arena_release(mdt_arena *a) {
    struct mdt_arena_chunk *c = a->chunks;
    while (c) {
        struct mdt_arena_chunk *n = c->next;
        if (a->src)
            a->src->free(c->data);
        else
            mdt_free(c->data);
        mdt_free(c);
        c = n;
    }
    a->chunks = a->cur = NULL;
    a->used = 0;
    a->in_use = 0;
}

/* ---- timer ---- */
MDT_HOT_CLONES int64_t mdt_first_nonfinite(const float *v, int64_t n) {
    enum { BLOCK = 4096 };
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t e = n - b < BLOCK ? n : b + BLOCK;
        uint32_t bad = 0; /* exponent all ones: Inf or NaN; an OR over the block vectorises */
        for (int64_t i = b; i < e; i++) {
            uint32_t u;
            memcpy(&u, v + i, sizeof u);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        for (int64_t i = b; bad && i < e; i++)
            if (!isfinite(v[i]))
                return i;
    }
    return -1;
}

double mdt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double mdt_thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double mdt_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- counters ---- */
static mdt_counters g_counters;
mdt_counters *mdt_counters_get(void) { return &g_counters; }
void mdt_counters_reset(void) { memset(&g_counters, 0, sizeof g_counters); }

/* ---- RNG ---- */
void mdt_rng_seed(mdt_rng *r, uint64_t seed) {
    r->state = seed ^ 0x9e3779b97f4a7c15ull;
    r->has_spare = 0;
    r->spare = 0.0;
}

uint64_t mdt_rng_u64(mdt_rng *r) {
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double mdt_rng_uniform(mdt_rng *r) { return (double)(mdt_rng_u64(r) >> 11) * 0x1.0p-53; }

double mdt_rng_normal(mdt_rng *r) {
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u1 = mdt_rng_uniform(r), u2 = mdt_rng_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
    r->spare = rad * sin(th);
    r->has_spare = 1;
    return rad * cos(th);
}

mdt_status mdt_error_set(mdt_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(__FILE__, __LINE__, fmt, ap);
    va_end(ap);
    return code;
}
