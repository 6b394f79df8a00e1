/*
 * testhooks.h — the one test-only seam of the library. Tests (and the command's test mode, which
 * fills this from MESHDIT_TEST_* once at start-up) install a hooks struct; the library reads it
 * and never the environment, and never raises a signal itself. With nothing installed every hook
 * is off and costs one pointer load.
 */
#ifndef MDT_CORE_TESTHOOKS_H
#define MDT_CORE_TESTHOOKS_H

#include "meshdit.h"

typedef struct mdt_test_hooks {
    int shard_index_world; /* a rank's TP shard index is its world rank (the upstream bug) */
    int skip_cp_split;     /* every rank computes the whole sequence (the upstream bug) */
    int cfg_same_branch;   /* cfg group 1 computes the conditional branch too (a layout bug) */
    /* an uneven TP shard starts where an even one would (k floor(s/T)): neighbours overlap and
     * the last s mod T rows are never read (the off-by-one of a naive uneven split) */
    int uneven_even_starts;
    /* Called at named points of the library ("load": mid-load, "step": inside a forward's
     * first block, "stage": after MiniMax-H3's first block, between two blocks)
     * with the caller's world rank; a status other than MDT_OK makes the
     * library fail there as if the work had failed. NULL: no injection. */
    mdt_status (*at_point)(const char *phase, int world_rank);
    /* a NaN written at element nan_elem of this rank's rows of the first output stream of the
     * block `nan_stage` ("transformer_blocks.0"), after it ran, on every rank (rows that TP
     * ranks hold alike stay alike): a block whose output went non-finite. Host activations
     * only (the CPU backend; device rows are not guarded per stage). NULL: none. */
    const char *nan_stage;
    int64_t nan_elem;
    /* the tree whose proc/stat the run statistics read each forward's steal from (with
     * at_point("step") writing it: a hypervisor that steals a known time). NULL: this system */
    const char *proc_root;
} mdt_test_hooks;

/* Installs `h` (copied; NULL removes every hook). Not thread-safe: set before any work. */
void mdt_test_hooks_set(const mdt_test_hooks *h);
/* The hooks in force (all off when none were installed); never NULL. */
const mdt_test_hooks *mdt_test_hooks_get(void);
/* MDT_OK, or what the at_point hook returns for `phase` on `world_rank`. */
mdt_status mdt_test_point(const char *phase, int world_rank);

#endif /* MDT_CORE_TESTHOOKS_H */
