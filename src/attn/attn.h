/*
 * attn.h — attention dispatch: this rank's local query rows attend over the whole sequence,
 * which is spread over the context-parallel ranks: Ulysses (all-to-all over the Ulysses group:
 * heads scattered, sequence gathered), Ring (K/V blocks passed around a P2P ring, next block in
 * flight while the current one is computed, fp32 log-sum-exp merge), or both (unified: Ulysses
 * transform, ring over the ring group, inverse transform). Any sequence length and head count:
 * local lengths are exchanged on every call (never cached), ring blocks are padded to the longest
 * with the padded keys masked, and heads are split into U groups of near-equal size (the first
 * H mod U groups one larger; a group may be empty) instead of being padded.
 *
 * Not here: sequence splitting and gathering (the model's CP plan), TP (callers pass their
 * local heads).
 */
#ifndef MDT_ATTN_H
#define MDT_ATTN_H

#include "backend/backend.h"
#include "comm/mesh.h"

/* Self-attention of this rank's rows over the whole sequence: a->q, a->k, a->v [H, S_local, D]
 * head-major, this rank's a->Sq = S_local rows of its H local heads (RoPE and norms applied; a->Sk
 * and a->kv must equal a->Sq: the keys are the same rows, the other ranks' come over the mesh);
 * a->out token-major, row s at out + s*ld_out, heads at columns [0, H*D); a->lse unused (NULL).
 * mesh NULL (or R = U = 1): plain attention over the local rows. Scratch comes from `ar` and is
 * given back before returning; the per-member counts and displacements live in the mesh's host
 * scratch (member_i64), so one mesh runs one attention at a time. Collective over the Ulysses and
 * ring groups. Adds to the counters: attention FLOPs, query rows x heads (each query row once), key
 * rows x heads attended, and ring wait vs compute seconds. */
mdt_status mdt_attention(mdt_mesh *mesh, mdt_arena *ar, const mdt_attn_args *a);

/* Work (FLOPs) between two moves of a ring step's transfer while attention runs on the host:
 * ~1-2 ms of a CPU core, so a transfer across a 1 Gbit/s link never idles for long. A piece is
 * at least one query tile of one head (64 rows; 256 with bf16 operands), so against long key
 * blocks (4 x 64 x kv x D FLOPs above this) the pieces are longer. */
#define MDT_RING_POLL_FLOPS ((int64_t)1 << 25)

/* Heads of Ulysses member j when H local heads are split over U: [*h0, *h0 + *hn). */
void mdt_attn_head_group(int64_t H, int U, int j, int64_t *h0, int64_t *hn);

#endif /* MDT_ATTN_H */
