/*
 * cache.h — step caches inside the forward, as diffusers' hooks (diffusers/hooks/) run
 * them: state per generation and per branch (diffusers' cache_context name: "cond", "uncond"),
 * a decision per forward that every rank of the forward's mesh takes together.
 *
 * First-Block Cache (diffusers' FirstBlockCacheConfig, hooks/first_block_cache.py): the first
 * block always runs; its residual r = out - in of the hidden (image or video) stream is compared
 * with the residual of the last forward of the branch that ran every block:
 *     diff = mean |r - r_prev| / mean |r_prev|,
 * and when diff <= threshold the remaining blocks are skipped: the hidden stream leaves the
 * first block and gets the tail residual of that last full forward added (out_last -
 * head_out_last), where diffusers' hook adds it (its text-stream residual is added to rows
 * nothing reads afterwards, so it is not kept). r_prev and the tail residual only change on
 * forwards that compute. MagCache, TaylorSeer and text_kv: below.
 *
 * One decision, shared: the two sums are this rank's rows' (in double), gathered over the CP
 * group (TP ranks hold the same rows, bit for bit) and added in chunk order, so every rank of
 * the forward's mesh computes the same diff from the same numbers; the only dependence on the
 * layout left is the activations' own rounding (~1e-7 relative). Cached state is this rank's
 * rows only: no rank holds more than its share.
 */
#ifndef MDT_MODELS_CACHE_H
#define MDT_MODELS_CACHE_H

#include "core/core.h"

#include <stdint.h>

struct mdt_dit;

typedef enum mdt_cache_kind {
    MDT_CACHE_OFF = 0,
    MDT_CACHE_FIRST_BLOCK,
    MDT_CACHE_MAG,
    MDT_CACHE_TAYLOR,
    MDT_CACHE_TEXT_KV
} mdt_cache_kind;

#define MDT_TAYLOR_ORDERS 4         /* TaylorSeer's max_order at most */
#define MDT_CACHE_BIT(k) (1 << (k)) /* a family's supported caches, for mdt_cache_begin */

#define MDT_CACHE_RATIOS_MAX 1024 /* MagCache's mag_ratios (one per inference step) */
#define MDT_CACHE_SPEC_MAX 16383  /* bytes of a spec's text */

/* What --cache NAME[:key=value,...] asks for. */
typedef struct mdt_cache_spec {
    mdt_cache_kind kind;
    double threshold; /* first_block: diffusers' default 0.05; mag: 0.06 */
    /* mag (diffusers' MagCacheConfig): consecutive skips at most, the fraction of the first
     * steps that always compute, the steps the ratios are for, and the ratios (float32) */
    int max_skip_steps;
    double retention_ratio;
    int num_inference_steps;
    int nratios;
    float ratios[MDT_CACHE_RATIOS_MAX];
    /* taylorseer (diffusers' TaylorSeerCacheConfig): a full step every cache_interval steps from
     * disable_cache_before_step on, every step before it and from disable_cache_after_step
     * (MDT_CACHE_NEVER: None, never; any other value as diffusers compares it, negative
     * included); the expansion's order; factors kept in bf16 (taylor_factors_dtype
     * bfloat16, diffusers' default: half the bytes) or in f32 */
    int cache_interval, disable_before, disable_after, max_order, factors_bf16;
} mdt_cache_spec;
#define MDT_CACHE_NEVER (-(1 << 30)) /* disable_after: None */

/* Parses "first_block[:threshold=X]" (also "fbc") or "mag:mag_ratios=A/B/...[,threshold=X,
 * max_skip_steps=K,retention_ratio=R,num_inference_steps=N]" (also "magcache"; the ratios
 * interpolated to N as diffusers' nearest_interp does when their count differs); NULL, "" or
 * "none": off. MDT_E_INVALID naming the unknown cache or key, or the bad value. */
mdt_status mdt_cache_spec_parse(const char *s, mdt_cache_spec *out);
/* The spec's text for messages ("first_block:threshold=0.05"; "none"; MagCache's ratios
 * counted, not listed). */
void mdt_cache_spec_str(const mdt_cache_spec *sp, char *buf, size_t cap);
/* The spec's whole text, which mdt_cache_spec_parse reads back as the same cache (MagCache's
 * ratios listed): the report's. 1 when it is that; 0 when it would not fit cap or the spec limit
 * (MDT_CACHE_SPEC_MAX: 1024 ratios written with more digits than given), buf then holding
 * mdt_cache_spec_str's short form. */
int mdt_cache_spec_text(const mdt_cache_spec *sp, char *buf, size_t cap);
/* 1 when two specs ask for the same cache. */
int mdt_cache_spec_equal(const mdt_cache_spec *a, const mdt_cache_spec *b);

#define MDT_CACHE_BRANCHES 4  /* branches of one generation ("cond", "uncond", ...) */
#define MDT_CACHE_NAME_MAX 63 /* bytes of a branch name */

typedef struct mdt_cache_branch {
    char name[MDT_CACHE_NAME_MAX + 1];
    float *prev_res; /* [n_res] the first block's residual of the last full forward */
    int64_t n_res;
    /* [n_out] the first block's output of the hidden stream in that forward, then (have_tail)
     * the tail residual, the last block's output less it: the only stream read after the
     * blocks (the text stream's output is not), so the only one kept */
    float *head, *tail;
    int64_t n_out;
    int have_tail;     /* a full forward has run: the tail residual is there */
    double tail_flops; /* this rank's FLOPs of the blocks after the first, in that forward
                          (mag: of every block) */
    /* mag: diffusers' MagCacheState, its accumulators in float32 as torch computes them */
    float acc_ratio, acc_err;
    int acc_steps, step_index;
    /* taylorseer: the step (the hook's current_step), the last computed one (-1: none), and per
     * hooked attention output ("slot") its Taylor factors, this rank's rows */
    int ts_step, ts_last;
    struct mdt_taylor_slot *ts;
    int64_t nts;
    /* text_kv: the context the kept K/V were computed from, and per slot its K or V */
    float *kv_ctx;
    int64_t kv_nctx;
    float **kv;
    int64_t *kv_n;
    int64_t nkv;
    int kv_valid; /* the kept K/V are this forward's context's */
} mdt_cache_branch;

typedef struct mdt_taylor_slot {
    void *f[MDT_TAYLOR_ORDERS + 1]; /* [n] factor of each order: float32, or bf16 (uint16_t)
                                       with taylor_factors_dtype bfloat16 */
    int64_t n;
    int norders; /* orders held (0: none yet) */
    int updated; /* this forward wrote it (its order count is committed at the end) */
} mdt_taylor_slot;

/* One forward's decision, as the report and the server's reply give it. */
typedef struct mdt_cache_step {
    int branch;                      /* index into the cache's branches */
    int skipped;                     /* the remaining blocks were skipped */
    double diff;                     /* the statistic (NaN when there was nothing to compare) */
    int64_t blocks_run, blocks_skip; /* blocks of the forward */
    double flops_saved;              /* this rank's FLOPs the skip saved */
} mdt_cache_step;

typedef struct mdt_cache {
    mdt_cache_spec spec;
    int nbranches;
    mdt_cache_branch br[MDT_CACHE_BRANCHES];
    int cur;        /* the branch of the forward under way (-1: none selected) */
    int ts_compute; /* taylorseer: this forward runs the hooked modules (else predicts) */
    int in_forward; /* a family forward consulted the cache */
    double flops_at_head;
    mdt_cache_step last; /* the last forward's decision */
    mdt_cache_step *log; /* every forward of the generation */
    int64_t nlog, caplog;
    int64_t peak_bytes; /* the most state this rank kept at once (mdt_cache_note_bytes) */
    /* a tentative forward (mdt_cache_tentative): branch `tent_branch` as it was before it,
     * sharing every buffer the forward has not written (a written one is a fresh buffer) */
    int tent, tent_branch;
    mdt_cache_branch saved;
    mdt_cache_step saved_last;
    int64_t saved_nlog;
} mdt_cache;

/* A cache for one generation (no branch yet). */
mdt_status mdt_cache_create(const mdt_cache_spec *sp, mdt_cache **out);
void mdt_cache_free(mdt_cache *c);
/* The branch the next forward runs as (created on first use; at most MDT_CACHE_BRANCHES names,
 * each at most MDT_CACHE_NAME_MAX bytes). MDT_E_INVALID otherwise. */
mdt_status mdt_cache_select(mdt_cache *c, const char *branch);
/* The index of branch `branch` (-1 if the generation has none of that name). */
int mdt_cache_find(const mdt_cache *c, const char *branch);
/* The skips of the generation so far, and its forwards. */
int64_t mdt_cache_skipped(const mdt_cache *c);
/* Bytes of the state this rank keeps for the generation (every branch; a pending tentative
 * forward's saved side not counted). */
int64_t mdt_cache_bytes(const mdt_cache *c);
/* Raises peak_bytes to mdt_cache_bytes if that is more: called at each forward's end and before
 * a schedule lets its state go, so the report says what the generation held, not what is left. */
void mdt_cache_note_bytes(mdt_cache *c);

/* ---- a forward that may be undone (serve --cfg 2: a branch computed before it is asked for,
 * kept only if the request that comes is that forward's) ---- */
/* The selected branch's next forwards are tentative: until mdt_cache_commit, everything they
 * change (the branch's kept state, the generation's log) can be undone by mdt_cache_rollback.
 * A buffer such a forward writes is a fresh one (the old kept for the undo), so what it costs
 * is what it writes. MDT_E_INVALID when a tentative forward is already pending. */
mdt_status mdt_cache_tentative(mdt_cache *c);
/* Keeps (commit) or undoes (rollback) the tentative forwards; a no-op when none is pending. */
void mdt_cache_commit(mdt_cache *c);
void mdt_cache_rollback(mdt_cache *c);

/* ---- what a family's forward calls (the model's cache: mdt_dit's m->cache) ---- */

/* 1 when the model has a step cache on (mdt_cache_begin would return it): a forward refuses what
 * a cache cannot take before it begins, so that the cache's state is untouched. */
int mdt_cache_on(const struct mdt_dit *d);
/* The model's cache for this forward, or NULL when none is on. MDT_E_UNSUPPORTED naming the
 * family when `supported` (MDT_CACHE_BIT of each kind the family runs) lacks the cache's kind,
 * MDT_E_INVALID when no branch was selected. TaylorSeer: its schedule decides here. */
mdt_status mdt_cache_begin(const struct mdt_dit *d, int supported, int64_t blocks, mdt_cache **out);
/* A stream's rows on this rank: B elements of `rows` rows of `width`, element b at x + b ld
 * (ld = rows * width when dense). */
typedef struct mdt_cache_rows {
    float *x;
    int64_t rows, width, ld;
} mdt_cache_rows;
/* ---- TaylorSeer: attention outputs predicted from Taylor factors on the steps between full
 * ones (a schedule, the same on every rank) ---- */
/* The model's TaylorSeer cache for this forward, or NULL: the schedule's verdict is in
 * c->ts_compute. */
mdt_cache *mdt_cache_taylor_of(const struct mdt_dit *d);
/* 1 when the forward under way (or just recorded) predicts the hooked attention outputs (a
 * TaylorSeer step between full ones): the attention modules do not run, and the forward's
 * promise counts no attention. */
int mdt_cache_predicts(const mdt_cache *c);
/* Attention output `slot` (a family numbers its hooked modules' outputs from 0), batch element
 * b: x [rows, width] (rows ld floats apart) updates the factors (ts_compute) or receives the
 * prediction. */
mdt_status mdt_cache_taylor(mdt_cache *c, const struct mdt_dit *d, int64_t slot, int64_t b,
                            float *x, int64_t rows, int64_t width, int64_t ld);

/* ---- text_kv: an exact cache of the cross-attention's K/V over a context that does not change
 * between the steps of a generation (Wan's text and image context) ---- */
/* The model's text_kv cache for this forward, or NULL. */
mdt_cache *mdt_cache_kv_of(const struct mdt_dit *d);
/* At the forward's start: the context, text [nt] then image [ni] (NULL, 0: none), this rank's
 * copy (the same bits on every rank); the kept K/V stay valid when it is the kept one, bit for
 * bit, on every rank of the forward's mesh (agreed over TP and CP), else they are recomputed
 * this forward. */
mdt_status mdt_cache_kv_context(mdt_cache *c, const struct mdt_dit *d, const float *txt, int64_t nt,
                                const float *img, int64_t ni);
/* The kept buffer of `slot` (n floats, made on first use); *valid 1 when it holds this
 * context's values (else the caller computes into it). */
mdt_status mdt_cache_kv_slot(mdt_cache *c, int64_t slot, int64_t n, float **buf, int *valid);

/* ---- the block loop's three points, for a family's forward (each a no-op without a cache) ---- */
/* Before the first block: *x0 [n] a copy of the hidden stream's rows `hidden` (dense, from the
 * arena; NULL without a cache), and MagCache's decision (*skip: no block runs; the residual is
 * added to `hidden`). */
mdt_status mdt_cache_pre(mdt_cache *c, const struct mdt_dit *d, const mdt_cache_rows *hidden,
                         float **x0, int *skip);
/* After the first block: First-Block Cache's decision on x0 against hidden->x (dense), then its
 * skip (the tail residual added to `hidden`) or its keep of the first block's output. */
mdt_status mdt_cache_after_first(mdt_cache *c, const struct mdt_dit *d, const float *x0,
                                 const mdt_cache_rows *hidden, int *skip);
/* After the last block (or the skip): the hidden stream's rows `out` there (a view) give
 * First-Block Cache's tail residual (out - the first block's output) and MagCache's (out - x0);
 * then the forward's record of `ran` of `blocks` blocks. */
mdt_status mdt_cache_post(mdt_cache *c, const struct mdt_dit *d, const float *x0,
                          const mdt_cache_rows *out, int skip, int64_t ran, int64_t blocks);

#endif /* MDT_MODELS_CACHE_H */
