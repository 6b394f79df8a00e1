/*
 * core.h — status and thread-local errors, logging, accounting allocator, timers, counters.
 *
 * Everything else in meshdit depends on this module; it depends on nothing but libc.
 * MDT_FAIL records a message with file:line and returns the code; MDT_TRY passes a failure up.
 * The allocator counts live and peak bytes per process (one rank = one process), which is what
 * the plan report and the memory tests read. Counters of FLOPs and bytes moved live here too, so
 * that kernels and collectives can add to them without depending on the report code.
 */
#ifndef MDT_CORE_H
#define MDT_CORE_H

#include "meshdit.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

/* Records a formatted message and its source location for this thread. */
void mdt_fail_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prefixes the current message with "prefix: " (adds context on the way up). Returns `code`. */
mdt_status mdt_fail_prefix(mdt_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Clears the thread-local message. */
void mdt_error_clear(void);

/* Records the message and evaluates to `code` (visible to static analysis as that constant). */
#define MDT_FAIL(code, ...) (mdt_fail_at(__FILE__, __LINE__, __VA_ARGS__), (mdt_status)(code))

#define MDT_TRY(expr)                                                                              \
    do {                                                                                           \
        mdt_status mdt_try_s_ = (expr);                                                            \
        if (mdt_try_s_ != MDT_OK)                                                                  \
            return mdt_try_s_;                                                                     \
    } while (0)

/* Jumps to the local `fail:` label with `st` set, for functions that must clean up. */
#define MDT_CHECK(expr)                                                                            \
    do {                                                                                           \
        st = (expr);                                                                               \
        if (st != MDT_OK)                                                                          \
            goto fail;                                                                             \
    } while (0)

/* Renders `s`, a string taken from a file (tensor or shard name, dtype, metadata), for a one-line
 * message: printable ASCII and well-formed UTF-8 pass through; control bytes, DEL, backslash,
 * bytes that are not well-formed UTF-8 and the C1, line-separator and bidirectional-override
 * code points (which terminals act on) become \xNN per byte. The result always fits `n` bytes
 * (NUL included, n >= 8); a longer rendering is cut at a character boundary and ends in "...".
 * Returns `buf`; NULL `s` renders as "(null)". Never fails, allocates nothing. */
const char *mdt_escape(const char *s, char *buf, size_t n);
/* mdt_escape_line (meshdit.h) is mdt_escape with backslashes left as they are. */

/* `s` into buf [cap]; a longer text keeps its start and its end with " ... " between (on UTF-8
 * boundaries): a message's cause (its usual end) survives a long path (its usual start). */
void mdt_fit_text(const char *s, char *buf, size_t cap);
/* A buffer size for names in messages: 251 bytes of rendering, then "..." if cut. */
#define MDT_ESC_NAME 256

/* 1 if `s` is a plain decimal number, [-]digits[.digits][(e|E)[+-]digits] (ints: [-]digits),
 * whose value is finite, with that value in *out; 0 otherwise (*out untouched). What a user
 * writes as a number in a spec or a request: no space, '+', hex, inf or nan, which strtod also
 * takes. */
int mdt_decimal(const char *s, int ints, double *out);

/* ---- logging (stderr; rank prefix set by the command) ---- */
typedef enum { MDT_LOG_ERROR = 0, MDT_LOG_WARN, MDT_LOG_INFO, MDT_LOG_DEBUG } mdt_log_level;
void mdt_log_set_level(mdt_log_level lvl);
void mdt_log_set_rank(int rank);
void mdt_log(mdt_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- accounting allocator: 64-byte aligned, counts live/peak bytes ---- */
void *mdt_alloc(size_t nbytes);  /* uninitialised; NULL on failure (no message set) */
void *mdt_calloc(size_t nbytes); /* zeroed */
/* Resizes a block of mdt_alloc's (NULL: mdt_alloc), keeping its first min(old, new) bytes and
 * its alignment; NULL on failure, with p untouched (still to be freed). */
void *mdt_realloc(void *p, size_t nbytes);
void mdt_free(void *p); /* NULL ok */
int64_t mdt_mem_live(void);
int64_t mdt_mem_peak(void);
void mdt_mem_reset_peak(void);     /* peak := live */
int64_t mdt_mem_alloc_count(void); /* number of successful allocations since start */

/* ---- a bump arena for per-step activations: reset each step, grows only on first use ---- */
/* Device memory as core and comm see it: filled in by a device backend (core never calls a
 * device API itself). Arenas with this source hand out device memory; collectives stage device
 * buffers through host memory with it (the host-staged MPI path). */
typedef struct mdt_mem_source {
    void *(*alloc)(size_t bytes); /* NULL on failure */
    void (*free)(void *p);
    const char *what; /* "device" */
    int (*is_device)(const void *p);
    void (*to_host)(void *host_dst, const void *src, size_t bytes); /* synchronous */
    void (*to_device)(void *dst, const void *host_src, size_t bytes);
    void *(*host_alloc)(size_t bytes); /* page-locked, NULL on failure */
    void (*host_free)(void *p);
} mdt_mem_source;
/* The process's device memory (NULL: none, every pointer is host memory). */
const mdt_mem_source *mdt_mem_device(void);
void mdt_mem_set_device(const mdt_mem_source *src);
typedef struct mdt_arena {
    struct mdt_arena_chunk *chunks, *cur; /* cur == NULL: before the first chunk */
    const mdt_mem_source *src;            /* NULL: host memory */
    size_t used;                          /* bytes handed out from cur */
    int64_t in_use;                       /* bytes handed out since the reset */
    int64_t high_water;                   /* most bytes in use at once, over all steps */
} mdt_arena;
typedef struct mdt_arena_mark {
    struct mdt_arena_chunk *chunk;
    size_t used;
    int64_t in_use;
} mdt_arena_mark;
void mdt_arena_init(mdt_arena *a);
/* 64-byte aligned block of n floats; NULL (with message) on allocation failure. */
float *mdt_arena_floats(mdt_arena *a, int64_t n);
/* A point to come back to: blocks handed out after it are reused once rewound (per layer). */
mdt_arena_mark mdt_arena_mark_get(const mdt_arena *a);
void mdt_arena_rewind(mdt_arena *a, mdt_arena_mark mk);
/* Forgets every block handed out. The chunks stay (the same step again allocates nothing and
 * touches no fresh page) while they hold at most twice the high-water mark; past it they are
 * merged into one chunk of the high-water size. */
mdt_status mdt_arena_reset(mdt_arena *a);
void mdt_arena_release(mdt_arena *a);

/* ---- timers ---- */
double mdt_now(void); /* monotonic seconds */
/* CPU seconds this thread has run (not the time it waited for a core: a measurement that picks
 * between two code paths reads this, so another process's load cannot flip the pick). */
double mdt_thread_cpu_seconds(void);
/* Median of v[0:n] (n >= 1; the mean of the middle two for even n); sorts v in place. */
double mdt_median(double *v, int n);

/* ---- hot loops outside the CPU kernels ---- */
/* Compiles a function for the x86-64 baseline and for AVX2 (x86-64-v3), the one the CPU runs
 * chosen when the program loads (an ifunc); the library itself targets the baseline. For the
 * loader's conversions and checks; the CPU kernels have per-ISA builds of their own. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
/* (GCC only: with clang 14 the other units' calls to a clone stayed undefined at link time) */
#define MDT_HOT_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define MDT_HOT_CLONES
#endif
/* Index of the first NaN or Inf in v[0:n], or -1 if every value is finite. */
int64_t mdt_first_nonfinite(const float *v, int64_t n);

/* ---- counters (per process) ---- */
typedef enum {
    MDT_FLOP_LINEAR = 0,
    MDT_FLOP_ATTN,
    MDT_FLOP_OTHER,
    MDT_FLOP_KIND_COUNT
} mdt_flop_kind;
typedef struct mdt_counters {
    double flops[MDT_FLOP_KIND_COUNT];
    double seconds[MDT_FLOP_KIND_COUNT]; /* host seconds in the kernels of each kind (copies and
                                            fills count as other); on a device, launch time */
    int64_t attn_query_rows;             /* query rows x heads summed over attention calls */
    int64_t attn_kv_rows;                /* key rows x heads summed over attention calls */
    int64_t attn_calls;
    int64_t bytes_read;    /* checkpoint bytes read from disk */
    double ring_compute_s; /* seconds attending ring blocks */
    double ring_wait_s;    /* seconds waiting for ring transfers after computing */
    double prep_s;         /* seconds turning host inputs into device-ready tensors (uploads) */
} mdt_counters;
mdt_counters *mdt_counters_get(void);
void mdt_counters_reset(void);

/* ---- deterministic RNG (splitmix64 stream + Box-Muller), same numbers on every platform ---- */
typedef struct mdt_rng {
    uint64_t state;
    int has_spare;
    double spare;
} mdt_rng;
void mdt_rng_seed(mdt_rng *r, uint64_t seed);
uint64_t mdt_rng_u64(mdt_rng *r);
double mdt_rng_uniform(mdt_rng *r); /* [0, 1) */
double mdt_rng_normal(mdt_rng *r);  /* N(0, 1) */
#endif                              /* MDT_CORE_H */
