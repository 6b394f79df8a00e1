/*
 * attn.c — see attn.h. Layouts (one batch element):
 *   Ulysses forward: member j receives from member i its rows (S_i of them) of head group j;
 *     the send block for j is contiguous in head-major q ([h0_j, h0_j + hn_j) x S_local x D), the
 *     received blocks are unpacked into [hn, L, D] with the members' rows concatenated in member
 *     order (L = sum S_i): the sequence block of this ring coordinate.
 *   Ring: blocks of K|V packed as [2][hn][Lmax][D] (Lmax = longest block on the ring, padded
 *     rows masked via the kernel's valid-key count), double-buffered: block s + 1 is in flight
 *     while block s is attended. Step s holds the block of ring member (r - s) mod R.
 *   Ulysses inverse: the token-major block output [L, hn D] sends rows of member i back to it;
 *     received head groups land at their columns of `out`.
 */
#include "attn.h"

#include "backend/backend.h"
#include "parallel/plan.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void mdt_attn_head_group(int64_t H, int U, int j, int64_t *h0, int64_t *hn) {
    mdt_split_range(H, U, j, h0, hn);
}

/* One ring step's attention: s->q [hn, L, D] over the block K|V [hn, Lmax, D] (kv valid rows)
 * into s->out [L, ldO] and its log-sum-exp s->lse [hn, L]. With the next block in flight (rq) on
 * host memory, the work is cut into pieces of about MDT_RING_POLL_FLOPS (one head, a run of
 * query rows; each row's result does not depend on the cut) and the transfer is moved along
 * between pieces: the CPU transports move data only inside MPI calls. Once it has landed, the
 * rest of the work runs in whole calls (same bits, the kernel's full rate). On a device the
 * kernel runs whole (its launches are asynchronous; cutting them would only shrink them). */
static mdt_status step_attention(mdt_mesh *mesh, mdt_ring_req *rq, mdt_arena *ar,
                                 const mdt_attn_args *s) {
    const mdt_mem_source *dev = mdt_mem_device();
    if (!rq || (dev && dev->is_device(s->q)) || mdt_ring_progress(mesh, rq))
        return mdt_k_attention(ar, s);
    /* whole query tiles; with bf16 operands the kernel rounds a head's K and V once per call and
     * takes 256-row tiles, so a piece is at least 256 rows (that rounding is then at most one
     * value per 512 FLOPs) */
    const int64_t D = s->D, L = s->Sq, Lmax = s->Sk;
    const int64_t per_row = 4 * (s->kv > 0 ? s->kv : 1) * D; /* FLOPs of one query row */
    const int64_t least = mdt_backend_bf16() ? 256 : 64;
    int64_t rows = (MDT_RING_POLL_FLOPS / per_row + least - 1) / least * least;
    rows = rows < least ? least : rows;
    for (int64_t h = 0; h < s->H; h++)
        for (int64_t i0 = 0; i0 < L;) {
            /* once the block has landed, the rest runs in as few calls as the layout allows:
             * this head's remaining rows, then every remaining head at once (small pieces cost
             * the kernel ~7% of its rate: ring2's attention at 89.5 against 96.5 GFLOP/s) */
            const int landed = (h > 0 || i0 > 0) && mdt_ring_progress(mesh, rq);
            if (landed && i0 == 0) {
                mdt_attn_args rest = *s; // heads [h, H) <- Q [H - h, L, D] . K|V [kv, D]
                rest.q = s->q + h * L * D;
                rest.k = s->k + h * Lmax * D, rest.v = s->v + h * Lmax * D;
                rest.out = s->out + h * D, rest.lse = s->lse + h * L;
                rest.H = s->H - h;
                return mdt_k_attention(ar, &rest);
            }
            mdt_attn_args piece = *s; // [n, D] of head h <- Q [n, D] . K|V [kv, D]
            piece.q = s->q + (h * L + i0) * D;
            piece.k = s->k + h * Lmax * D, piece.v = s->v + h * Lmax * D;
            piece.out = s->out + i0 * s->ld_out + h * D, piece.lse = s->lse + h * L + i0;
            piece.H = 1, piece.Sq = landed || L - i0 < rows ? L - i0 : rows;
            MDT_TRY(mdt_k_attention(ar, &piece));
            i0 += piece.Sq;
        }
    return MDT_OK;
}

/* Attention of a->q [hn, L, D] (hn = a->H, L = a->Sq, with its own K and V a->k, a->v of the
 * same rows) over the blocks of every ring member (ring group), into a->out [L, ld_out]. */
static mdt_status ring_attention(mdt_mesh *mesh, mdt_arena *ar, const mdt_attn_args *a) {
    const int R = mesh->R, r = mesh->r;
    const int64_t hn = a->H, L = a->Sq, D = a->D;
    /* [R]: the last of the mesh's per-member arrays (mdt_attention's Ulysses path holds the rest)
     */
    int64_t *lens = mesh->member_i64 + 8 * (mesh->member_i64_n / MDT_MESH_MEMBER_I64);
    int64_t Lmax = 0, total = 0;
    MDT_TRY(mdt_allgather_i64(mesh, MDT_GROUP_RING, L, lens));
    for (int i = 0; i < R; i++) {
        Lmax = lens[i] > Lmax ? lens[i] : Lmax;
        total += lens[i];
    }
    const int64_t blk = hn * Lmax * D; /* floats of K (or V) in a packed block */
    float *cur = mdt_arena_floats(ar, 2 * blk), *nxt = mdt_arena_floats(ar, 2 * blk);
    float *lse = mdt_arena_floats(ar, hn * L), *tl = mdt_arena_floats(ar, hn * L);
    float *to = mdt_arena_floats(ar, L * hn * D);
    if (!cur || !nxt || !lse || !tl || !to)
        return MDT_E_NOMEM;
    for (int64_t h = 0; L < Lmax && h < 2 * hn; h++) /* own block, rows padded to Lmax (zeros) */
        mdt_k()->fill(cur + (h * Lmax + L) * D, (Lmax - L) * D, 0.0f); // rows [L, Lmax) of head h
    mdt_k()->copy2d(cur, Lmax * D, a->k, L * D, hn, L * D);       // [hn, Lmax, D] <- [hn, L, D]
    mdt_k()->copy2d(cur + blk, Lmax * D, a->v, L * D, hn, L * D); // [hn, Lmax, D] <- [hn, L, D]
    mdt_counters *cn = mdt_counters_get();
    for (int s = 0; s < R; s++) {
        const int src = (r - s + R) % R;
        mdt_ring_req rq = {.n = 0}, *next = s < R - 1 ? &rq : NULL;
        if (next) /* the next block travels while this one is computed */
            MDT_TRY(mdt_ring_start(mesh, MDT_GROUP_RING, cur, nxt, 2 * blk, next));
        /* step 0 writes straight to the output, later steps to `to`, merged in by LSE */
        const mdt_attn_args step = {.q = a->q,
                                    .k = cur,
                                    .v = cur + blk,
                                    .out = s == 0 ? a->out : to,
                                    .ld_out = s == 0 ? a->ld_out : hn * D,
                                    .lse = s == 0 ? lse : tl,
                                    .H = hn,
                                    .Sq = L,
                                    .Sk = Lmax,
                                    .kv = lens[src],
                                    .D = D,
                                    .scale = a->scale}; // [L, hn D]
        double t0 = mdt_now();
        mdt_status st = step_attention(mesh, next, ar, &step);
        if (st == MDT_OK && s > 0)
            mdt_k()->lse_merge(a->out, a->ld_out, lse, to, hn * D, tl, hn, L, D);
        double t1 = mdt_now();
        cn->ring_compute_s += t1 - t0;
        if (st != MDT_OK) { /* the block in flight lands in arena memory the caller is about to
                             * reuse: it is received first (every member started this step) */
            char why[256];
            snprintf(why, sizeof why, "%s", mdt_last_error());
            if (next)
                (void)mdt_ring_wait(mesh, next);
            return MDT_FAIL(st, "%s", why);
        }
        if (next) {
            MDT_TRY(mdt_ring_wait(mesh, next));
            cn->ring_wait_s += mdt_now() - t1;
            float *t = cur;
            cur = nxt, nxt = t;
        }
    }
    cn->attn_query_rows += hn * L;
    cn->attn_kv_rows += hn * total;
    return MDT_OK;
}

mdt_status mdt_attention(mdt_mesh *mesh, mdt_arena *ar, const mdt_attn_args *a) {
    const int U = mesh ? mesh->U : 1, R = mesh ? mesh->R : 1;
    const int64_t H = a->H, S_local = a->Sq, D = a->D;
    if (a->Sk != S_local || a->kv != S_local || a->lse)
        return MDT_FAIL(MDT_E_INVALID,
                        "attention: a self-attention call attends its own %lld rows (Sk %lld, kv "
                        "%lld) and merges nothing (lse)",
                        (long long)S_local, (long long)a->Sk, (long long)a->kv);
    mdt_arena_mark mk = mdt_arena_mark_get(ar);
    mdt_status st = MDT_OK;
    if (U == 1 && R == 1) {
        MDT_TRY(mdt_k_attention(ar, a));
        mdt_counters *cn = mdt_counters_get();
        cn->attn_query_rows += H * S_local;
        cn->attn_kv_rows += H * S_local;
        mdt_arena_rewind(ar, mk);
        return MDT_OK;
    }
    if (U == 1) { /* ring only: the block is the local chunk, written straight to out */
        st = ring_attention(mesh, ar, a);
        mdt_arena_rewind(ar, mk);
        return st;
    }
    /* Ulysses forward: my head group over the rows of every member of my Ulysses group */
    const int me = mesh->u;
    /* per-member sizes in the mesh's host scratch (8 arrays of U; ring_attention takes the 9th) */
    const int64_t stride = mesh->member_i64_n / MDT_MESH_MEMBER_I64;
    int64_t *lens = mesh->member_i64, *offs = lens + stride, *h0 = offs + stride, *hc = h0 + stride,
            *sc = hc + stride, *sd = sc + stride, *rc = sd + stride, *rd = rc + stride, L = 0;
    MDT_TRY(mdt_allgather_i64(mesh, MDT_GROUP_ULYSSES, S_local, lens));
    for (int i = 0; i < U; i++) {
        offs[i] = L;
        L += lens[i];
        mdt_attn_head_group(H, U, i, &h0[i], &hc[i]);
    }
    const int64_t hn = hc[me];
    float *qkv[3], *recv = mdt_arena_floats(ar, hn * L * D);
    for (int x = 0; x < 3; x++)
        qkv[x] = mdt_arena_floats(ar, hn * L * D); // [hn, L, D]
    float *ob = mdt_arena_floats(ar, L * hn * D);  // [L, hn*D] block output
    float *back = mdt_arena_floats(ar, S_local * H * D);
    if (!recv || !qkv[0] || !qkv[1] || !qkv[2] || !ob || !back)
        return MDT_E_NOMEM;
    const float *src[3] = {a->q, a->k, a->v};
    /* my own rows of my head group go straight to their place (one copy, not MPI's and then the
     * unpack's): the collective moves only the other members' blocks */
    for (int i = 0; i < U; i++) {
        sc[i] = i == me ? 0 : hc[i] * S_local * D, sd[i] = h0[i] * S_local * D;
        rc[i] = i == me ? 0 : hn * lens[i] * D, rd[i] = hn * offs[i] * D;
    }
    for (int x = 0; x < 3 && st == MDT_OK; x++) {
        st = mdt_alltoallv_floats(mesh, MDT_GROUP_ULYSSES, src[x], sc, sd, recv, rc, rd);
        for (int i = 0; st == MDT_OK && i < U; i++) /* member i's rows of every head */
            mdt_k()->copy2d(qkv[x] + offs[i] * D, L * D, i == me ? src[x] + sd[me] : recv + rd[i],
                            lens[i] * D, hn,
                            lens[i] * D); // [hn, L, D] rows offs_i.. <- [hn, lens_i, D]
    }
    if (st == MDT_OK) { /* my head group over the gathered rows: ob [L, hn D] */
        const mdt_attn_args blk = {.q = qkv[0],
                                   .k = qkv[1],
                                   .v = qkv[2],
                                   .out = ob,
                                   .ld_out = hn * D,
                                   .H = hn,
                                   .Sq = L,
                                   .Sk = L,
                                   .kv = L,
                                   .D = D,
                                   .scale = a->scale};
        if (R > 1) {
            st = ring_attention(mesh, ar, &blk);
        } else {
            st = mdt_k_attention(ar, &blk);
            mdt_counters *cn = mdt_counters_get();
            cn->attn_query_rows += hn * L;
            cn->attn_kv_rows += hn * L;
        }
    }
    /* Ulysses inverse: rows of member i go back to it; head group j lands at columns h0_j D */
    for (int i = 0; i < U; i++) {
        sc[i] = i == me ? 0 : lens[i] * hn * D, sd[i] = offs[i] * hn * D;
        rc[i] = i == me ? 0 : S_local * hc[i] * D, rd[i] = S_local * h0[i] * D;
    }
    if (st == MDT_OK)
        st = mdt_alltoallv_floats(mesh, MDT_GROUP_ULYSSES, ob, sc, sd, back, rc, rd);
    for (int j = 0; st == MDT_OK && j < U; j++) /* head group j at its columns (mine from ob) */
        mdt_k()->copy2d(a->out + h0[j] * D, a->ld_out, j == me ? ob + sd[me] : back + rd[j],
                        hc[j] * D, S_local,
                        hc[j] * D); // [S_local, H D] cols h0_j D.. <- [S_local, hc_j D]
    mdt_arena_rewind(ar, mk);
    return st;
}
