/*
 * run_stats.h — what one mdt_sample did (meshdit.h: mdt_run_stats), shared by the sampler that
 * fills it and the report that reads it.
 */
#ifndef MDT_SAMPLER_RUN_STATS_H
#define MDT_SAMPLER_RUN_STATS_H

#include "comm/mesh.h"
#include "core/core.h"

/* What one rank did in the last step, gathered to world rank 0 as bytes: the public facts
 * (meshdit.h: mdt_rank_stats) and what only the report shows. */
typedef struct mdt_rank_facts {
    mdt_rank_stats pub;
    char host[64];                     /* this rank's host */
    int64_t coll[MDT_COLL_KIND_COUNT]; /* bytes sent per collective kind */
    double wait_s[MDT_WAIT_BUCKETS];   /* seconds blocked in them and the world's agreements */
    double step_s;                     /* the wall time of the step these facts are of */
    double steal_s; /* the hypervisor's steal from this rank's vCPU in that step (-1: unknown) */
} mdt_rank_facts;

struct mdt_run_stats {
    int steps, sampled;
    double step_median_s;
    double *step_s;          /* [2, steps] this rank's wall seconds of each forward, in order,
                              * then the steal row (mdt_run_stats_steal) */
    int nranks;              /* entries of facts: the world on rank 0, else 1 */
    mdt_rank_facts *facts;   /* [nranks] */
    struct mdt_cache *cache; /* the run's step cache and its decisions (NULL: none) */
};

/* [steps] per forward the most seconds the hypervisor took from any rank's vCPU (rank 0; elsewhere
 * its own), -1 unknown (core/steal.h): step_s's second row. */
double *mdt_run_stats_steal(const mdt_run_stats *s);

#endif /* MDT_SAMPLER_RUN_STATS_H */
