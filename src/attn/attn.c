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

/* One ring step's attention of Q [hn, L, D] over the block K|V [hn, Lmax, D] (kv valid rows) into
 * O [L, ldO] and its log-sum-exp [hn, L]. With the next block in flight (rq) on host memory, the
 * work is cut into pieces of about MDT_RING_POLL_FLOPS (one head, a run of query rows; each row's
 * result does not depend on the cut) and the transfer is moved along between pieces: the CPU
 * transports move data only inside MPI calls. On a device the kernel runs whole (its launches are
 * asynchronous; cutting them would only shrink them). */
static mdt_status step_attention(mdt_mesh *mesh, mdt_ring_req *rq, mdt_arena *ar, const float *Q,
                                 const float *K, const float *V, float *O, int64_t ldO, float *lse,
                                 int64_t hn, int64_t L, int64_t Lmax, int64_t kv, int64_t D,
                                 float scale) {
    const mdt_mem_source *dev = mdt_mem_device();
    if (!rq || (dev && dev->is_device(Q)) || mdt_ring_progress(mesh, rq))
        return mdt_k_attention(ar, Q, K, V, O, ldO, lse, hn, L, Lmax, kv, D, scale);
    /* whole query tiles; with bf16 operands the kernel rounds a head's K and V once per call and
     * takes 256-row tiles, so a piece is at least 256 rows (that rounding is then at most one
     * value per 512 FLOPs) */
    const int64_t per_row = 4 * (kv > 0 ? kv : 1) * D; /* FLOPs of one query row */
    const int64_t least = mdt_backend_bf16() ? 256 : 64;
    int64_t rows = (MDT_RING_POLL_FLOPS / per_row + least - 1) / least * least;
    rows = rows < least ? least : rows;
    int pending = 1;
    for (int64_t h = 0; h < hn; h++)
        for (int64_t i0 = 0; i0 < L; i0 += rows) {
            const int64_t n = L - i0 < rows ? L - i0 : rows;
            MDT_TRY(mdt_k_attention(ar, Q + (h * L + i0) * D, K + h * Lmax * D, V + h * Lmax * D,
                                    O + i0 * ldO + h * D, ldO, lse + h * L + i0, 1, n, Lmax, kv, D,
                                    scale)); // [n, D] of head h <- Q [n, D] . K|V [kv, D]
            if (pending)
                pending = !mdt_ring_progress(mesh, rq);
        }
    return MDT_OK;
}

/* Attention of Q [hn, L, D] over the blocks of every ring member (ring group), O [L, ldO]. */
static mdt_status ring_attention(mdt_mesh *mesh, mdt_arena *ar, const float *Q, const float *K,
                                 const float *V, int64_t hn, int64_t L, int64_t D, float scale,
                                 float *O, int64_t ldO) {
    const int R = mesh->R, r = mesh->r;
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
    mdt_k()->fill(cur, 2 * blk, 0.0f);                         /* own block, rows padded to Lmax */
    mdt_k()->copy2d(cur, Lmax * D, K, L * D, hn, L * D);       // [hn, Lmax, D] <- [hn, L, D]
    mdt_k()->copy2d(cur + blk, Lmax * D, V, L * D, hn, L * D); // [hn, Lmax, D] <- [hn, L, D]
    mdt_counters *cn = mdt_counters_get();
    for (int s = 0; s < R; s++) {
        const int src = (r - s + R) % R;
        mdt_ring_req rq = {.n = 0}, *next = s < R - 1 ? &rq : NULL;
        if (next) /* the next block travels while this one is computed */
            MDT_TRY(mdt_ring_start(mesh, MDT_GROUP_RING, cur, nxt, 2 * blk, next));
        double t0 = mdt_now();
        mdt_status st;
        if (s == 0) {
            st = step_attention(mesh, next, ar, Q, cur, cur + blk, O, ldO, lse, hn, L, Lmax,
                                lens[src], D, scale); // O [L, hn D]
        } else {
            st = step_attention(mesh, next, ar, Q, cur, cur + blk, to, hn * D, tl, hn, L, Lmax,
                                lens[src], D, scale); // to [L, hn D]
            if (st == MDT_OK)
                mdt_k()->lse_merge(O, ldO, lse, to, hn * D, tl, hn, L, D);
        }
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

mdt_status mdt_attention(mdt_mesh *mesh, mdt_arena *ar, const float *q, const float *k,
                         const float *v, int64_t H, int64_t S_local, int64_t D, float scale,
                         float *out, int64_t ld_out) {
    const int U = mesh ? mesh->U : 1, R = mesh ? mesh->R : 1;
    mdt_arena_mark mk = mdt_arena_mark_get(ar);
    mdt_status st = MDT_OK;
    if (U == 1 && R == 1) {
        MDT_TRY(mdt_k_attention(ar, q, k, v, out, ld_out, NULL, H, S_local, S_local, S_local, D,
                                scale));
        mdt_counters *cn = mdt_counters_get();
        cn->attn_query_rows += H * S_local;
        cn->attn_kv_rows += H * S_local;
        mdt_arena_rewind(ar, mk);
        return MDT_OK;
    }
    if (U == 1) { /* ring only: the block is the local chunk, written straight to out */
        st = ring_attention(mesh, ar, q, k, v, H, S_local, D, scale, out, ld_out);
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
    const float *src[3] = {q, k, v};
    for (int i = 0; i < U; i++) {
        sc[i] = hc[i] * S_local * D, sd[i] = h0[i] * S_local * D;
        rc[i] = hn * lens[i] * D, rd[i] = hn * offs[i] * D;
    }
    for (int x = 0; x < 3 && st == MDT_OK; x++) {
        st = mdt_alltoallv_floats(mesh, MDT_GROUP_ULYSSES, src[x], sc, sd, recv, rc, rd);
        for (int i = 0; st == MDT_OK && i < U; i++) /* member i's rows of every head */
            mdt_k()->copy2d(qkv[x] + offs[i] * D, L * D, recv + rd[i], lens[i] * D, hn,
                            lens[i] * D); // [hn, L, D] rows offs_i.. <- [hn, lens_i, D]
    }
    if (st == MDT_OK) {
        if (R > 1) {
            st = ring_attention(mesh, ar, qkv[0], qkv[1], qkv[2], hn, L, D, scale, ob, hn * D);
        } else {
            st = mdt_k_attention(ar, qkv[0], qkv[1], qkv[2], ob, hn * D, NULL, hn, L, L, L, D,
                                 scale);
            mdt_counters *cn = mdt_counters_get();
            cn->attn_query_rows += hn * L;
            cn->attn_kv_rows += hn * L;
        }
    }
    /* Ulysses inverse: rows of member i go back to it; head group j lands at columns h0_j D */
    for (int i = 0; i < U; i++) {
        sc[i] = lens[i] * hn * D, sd[i] = offs[i] * hn * D;
        rc[i] = S_local * hc[i] * D, rd[i] = S_local * h0[i] * D;
    }
    if (st == MDT_OK)
        st = mdt_alltoallv_floats(mesh, MDT_GROUP_ULYSSES, ob, sc, sd, back, rc, rd);
    for (int j = 0; st == MDT_OK && j < U; j++) /* head group j at its columns */
        mdt_k()->copy2d(out + h0[j] * D, ld_out, back + rd[j], hc[j] * D, S_local,
                        hc[j] * D); // [S_local, H D] cols h0_j D.. <- [S_local, hc_j D]
    mdt_arena_rewind(ar, mk);
    return st;
}
