/*
 * run_stats.h — what one mdt_sample did (meshdit.h: mdt_run_stats), shared by the sampler that
 * fills it and the report that reads it.
 */
#ifndef MDT_API_RUN_STATS_H
#define MDT_API_RUN_STATS_H

#include "comm/mesh.h"
#include "core/core.h"

/* What one rank did in the last step, gathered to world rank 0 as bytes. */
typedef struct mdt_rank_facts {
    int rank, t, r, u, cp_index;
    int node_rank, node_size; /* among the ranks sharing this rank's host */
    char host[64];
    int64_t heads_local, weight_bytes, peak_bytes, max_rss_kib, bytes_read;
    double flops[MDT_FLOP_KIND_COUNT];
    double seconds[MDT_FLOP_KIND_COUNT]; /* in the kernels of each kind */
    int64_t attn_calls, attn_q, attn_kv;
    int64_t coll[MDT_COLL_KIND_COUNT];
    int64_t group[MDT_GROUP_COUNT];
    int64_t world_colls; /* collectives over the whole world: agreements, barriers */
    double ring_wait_s, ring_compute_s, prep_s;
} mdt_rank_facts;

struct mdt_run_stats {
    int steps, sampled;
    double step_median_s;
    int nranks;            /* entries of facts/pub: the world on rank 0, else 1 */
    mdt_rank_facts *facts; /* [nranks] */
    mdt_rank_stats *pub;   /* [nranks], the public view of facts */
};

#endif /* MDT_API_RUN_STATS_H */
