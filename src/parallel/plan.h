/*
 * plan.h — parallel plans as data, and the pure shard maths that turns them into slices.
 *
 * A model's weight table lists, per checkpoint tensor, its full shape and TP style; its CP plan
 * lists which inputs split on the sequence and which outputs gather. The functions here map
 * (style, degree T, coordinate k) to local shapes and index ranges, and (length S, degree P,
 * chunk c) to sequence chunks. No MPI and no I/O: testable by looping over coordinates.
 */
#ifndef MDT_PLAN_H
#define MDT_PLAN_H

#include "core/core.h"

typedef enum mdt_tp_style {
    MDT_TP_REPLICATED = 0,          /* every rank holds the whole tensor */
    MDT_TP_COLWISE,                 /* shard dim 0 (output features; a colwise bias too) */
    MDT_TP_ROWWISE,                 /* shard dim 1 (input features); all-reduce, bias once */
    MDT_TP_PACKED_COLWISE,          /* dim 0 holds blocks; shard each block */
    MDT_TP_PACKED_ROWWISE,          /* dim 1 holds blocks; shard each block */
    MDT_TP_REPLICATED_INPUT_ROWWISE /* rowwise on a replicated input the rank slices itself */
} mdt_tp_style;

const char *mdt_tp_style_name(mdt_tp_style s);

/* Which token rows of a forward a linear weight multiplies (the planner's FLOPs and memory): a
 * family declares it with the table (family.h: mdt_wtable_rows); tensors that are not linears
 * (norm weights, tables read by index) run on none. */
typedef enum mdt_rows {
    MDT_ROWS_UNSET = 0, /* a linear declared without rows: refused by the table's check */
    MDT_ROWS_NONE,      /* not a linear's weight: no GEMM rows */
    MDT_ROWS_ALL,       /* every row of the rank's sequence chunk */
    MDT_ROWS_IMAGE,     /* the latent rows only (a joint model's two-stream blocks, embedders) */
    MDT_ROWS_TEXT,      /* the text stream's rows (joint: its share of the chunk; cross: whole) */
    MDT_ROWS_ONE        /* one row per sample: conditioning (timestep, guidance, AdaLN) */
} mdt_rows;
const char *mdt_rows_name(mdt_rows r);

#define MDT_MAX_BLOCKS 8
#define MDT_NAME_MAX 160

typedef struct mdt_weight_spec {
    char name[MDT_NAME_MAX];
    int ndim;
    int64_t shape[2];
    mdt_tp_style style;
    int nblocks;                    /* packed styles: blocks along the shard dim */
    int64_t blocks[MDT_MAX_BLOCKS]; /* absolute block sizes, summing to the shard dim */
    /* > 0: the checkpoint stores the tensor with these dims, held as the 2-D view `shape` =
     * [stored[0], product of the rest] (row-major: the same bytes), e.g. a Conv3d weight
     * [out, in, kt, kh, kw] used as the linear [out, in kt kh kw]; 0: stored as `shape` */
    int stored_ndim;
    int64_t stored[MDT_MAX_DIMS];
    mdt_rows rows; /* the rows it multiplies (linears); MDT_ROWS_NONE for other tensors */
    /* 1: a block of the shard dim that T does not divide splits unevenly, as mdt_split_range cuts
     * a sequence (the first s mod T coordinates one row or column more), for widths a forward
     * takes from the local shape alone (an FFN's hidden features); 0: T must divide each block */
    int uneven;
} mdt_weight_spec;

/* The dims the checkpoint stores w with (its `stored` dims, else its view); returns ndim. */
int mdt_weight_stored_shape(const mdt_weight_spec *w, int64_t shape[MDT_MAX_DIMS]);

/* Dimension a style shards (0 or 1), or -1 for replicated. */
int mdt_tp_shard_dim(mdt_tp_style s);

/* Ranges along the shard dim that coordinate k of T owns: per block b of size s_b at offset o_b,
 * o_b + mdt_split_range(s_b, T, k), i.e. [o_b + k s_b/T, o_b + (k+1) s_b/T) when T divides s_b;
 * otherwise (w->uneven only) the first s_b mod T coordinates get one more. `starts`/`lens` hold
 * MDT_MAX_BLOCKS entries; `*n` gets the count (1 for replicated: the whole dim 0).
 * MDT_E_INVALID (naming the tensor and the numbers) if T does not divide a block of an even
 * tensor, an uneven block is smaller than T (a coordinate would own nothing), or k is out of
 * range. */
mdt_status mdt_shard_ranges(const mdt_weight_spec *w, int T, int k, int64_t *starts, int64_t *lens,
                            int *n);
/* Local shape of w on coordinate k of a degree-T group (the same on every coordinate unless w
 * splits unevenly at T; coordinate 0 then holds the most). */
mdt_status mdt_shard_local_shape(const mdt_weight_spec *w, int T, int k, int64_t local[2]);
/* 1 if w splits unevenly at degree T (a block of its shard dim that T does not divide). */
int mdt_shard_uneven_at(const mdt_weight_spec *w, int T);

/* Sequence chunk c of P over length S: the first S mod P chunks get one extra row. */
void mdt_split_range(int64_t S, int P, int c, int64_t *start, int64_t *len);

/* A model's CP plan: inputs split on entry (name, dim), outputs gathered on exit (name, dim,
 * and for outputs picked from a gathered packed sequence, `by`: the input holding the packed row
 * of each output row). The models' CP executor (models/cp.h) runs exactly this plan. */
typedef struct mdt_cp_split {
    const char *input;
    int dim;
    const char *by; /* gathers only: index input, or NULL for a plain concatenation */
} mdt_cp_split;
typedef struct mdt_cp_plan {
    int nsplit;
    mdt_cp_split split[8];
    int ngather;
    mdt_cp_split gather[4];
} mdt_cp_plan;

#endif /* MDT_PLAN_H */
