/*
 * shard.h — moving TP shards between a full tensor and a rank's local slice, by the ranges
 * plan.h computes (rows for dim-0 styles, per-row pieces for dim-1 styles, per block for packed
 * ones). Pure memory copies: no MPI, no I/O.
 */
#ifndef MDT_PARALLEL_SHARD_H
#define MDT_PARALLEL_SHARD_H

#include "parallel/plan.h"

/* Moves pieces between a full tensor and the local shard of coordinate k of T:
 * to_local = 1: local <- full; 0: full <- local (the pieces k owns). */
void mdt_shard_copy(const mdt_weight_spec *w, int T, int k, float *full, float *local,
                    int to_local);

#endif /* MDT_PARALLEL_SHARD_H */
