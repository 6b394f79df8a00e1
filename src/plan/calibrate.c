/*
 * calibrate.c — mdt_calibrate (meshdit.h): the planner's device spec measured on the machine the
 * job runs on. Compute: on every rank at once (so ranks that share a host share its memory
 * bandwidth as they will in the run), the kernel front table's linears at the model's weight
 * shapes with a CP rank's rows, its attention (local queries x every key) and its element-wise
 * kernels; the rates are what the kernels' own FLOP and time counters say (the median of five
 * passes), the slowest rank's.
 * Links: for each collective a mesh whose axis lies inside a host (the ranks sharing a host) or
 * across hosts (one rank per host), checked by comparing host names, then the mesh's own
 * collectives at two message sizes: latency and bandwidth (bytes sent per rank, as the mesh
 * counts them) from the two medians, the slowest rank's.
 */
#define _POSIX_C_SOURCE 200809L
#include "models/info.h"
#include "attn/attn.h"
#include "backend/backend.h"
#include "comm/mesh.h"
#include "core/core.h"
#include "core/sysmem.h"
#include "plan/cost.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { REPS = 2, PASSES = 5 };

static void fill_random(float *x, int64_t n, uint64_t seed) {
    mdt_rng r;
    mdt_rng_seed(&r, seed);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(mdt_rng_uniform(&r) - 0.5);
}

/* ---- compute ---- */

/* The model's linears (distinct [out, in] shapes, AdaLN left out: one row per sample) on M rows,
 * REPS times after a warm-up. */
static mdt_status run_linears(const mdt_model *m, int64_t M) {
    int64_t seen[64][2];
    int ns = 0;
    for (int i = 0; i < m->table.n && ns < 64; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        if (w->ndim != 2 || w->style == MDT_TP_REPLICATED_INPUT_ROWWISE || w->shape[1] < 16)
            continue;
        int dup = 0;
        for (int k = 0; k < ns; k++)
            dup |= seen[k][0] == w->shape[0] && seen[k][1] == w->shape[1];
        if (dup)
            continue;
        seen[ns][0] = w->shape[0], seen[ns][1] = w->shape[1], ns++;
    }
    for (int k = 0; k < ns; k++) {
        const int64_t N = seen[k][0], K = seen[k][1];
        float *x = malloc(sizeof(float) * (size_t)(M * K));  // [M, K]
        float *wt = malloc(sizeof(float) * (size_t)(N * K)); // [N, K]
        float *y = malloc(sizeof(float) * (size_t)(M * N));  // [M, N]
        if (!x || !wt || !y) {
            free(x), free(wt), free(y);
            return MDT_FAIL(MDT_E_NOMEM, "calibrate: out of memory for a [%lld, %lld] linear",
                            (long long)N, (long long)K);
        }
        fill_random(x, M * K, 1), fill_random(wt, N * K, 2);
        mdt_counters *c = mdt_counters_get();
        const double f0 = c->flops[MDT_FLOP_LINEAR], s0 = c->seconds[MDT_FLOP_LINEAR];
        mdt_k()->linear(x, K, wt, NULL, NULL, y, N, M, K, N); /* warm-up: first touch of y */
        c->flops[MDT_FLOP_LINEAR] = f0, c->seconds[MDT_FLOP_LINEAR] = s0; /* not counted */
        for (int r = 0; r < REPS; r++)
            mdt_k()->linear(x, K, wt, NULL, NULL, y, N, M, K, N); // [M, N] = x w^T
        free(x), free(wt), free(y);
    }
    return MDT_OK;
}

/* Attention of Sq local queries against Sk keys over H heads of width D, REPS times. */
static mdt_status run_attention(int64_t H, int64_t Sq, int64_t Sk, int64_t D) {
    const int64_t nws = mdt_k()->attention_ws_floats(Sk, D, 0);
    float *q = malloc(sizeof(float) * (size_t)(H * Sq * D));  // [H, Sq, D]
    float *kv = malloc(sizeof(float) * (size_t)(H * Sk * D)); // [H, Sk, D] (keys = values)
    float *o = malloc(sizeof(float) * (size_t)(Sq * H * D));  // [Sq, H D]
    float *ws = malloc(sizeof(float) * (size_t)(nws > 0 ? nws : 1));
    mdt_status st = MDT_OK;
    if (!q || !kv || !o || !ws)
        st = MDT_FAIL(MDT_E_NOMEM, "calibrate: out of memory for attention over %lld keys",
                      (long long)Sk);
    if (st == MDT_OK) {
        fill_random(q, H * Sq * D, 3), fill_random(kv, H * Sk * D, 4);
        const float scale = 1.0f / sqrtf((float)D);
        for (int r = 0; r < REPS; r++)
            mdt_k()->attention(q, kv, kv, o, H * D, NULL, H, Sq, Sk, Sk, D, scale, 0, ws);
    }
    free(q), free(kv), free(o), free(ws);
    return st;
}

/* The element-wise kernels of a block on M rows of width C (feed-forward width F), REPS times. */
static mdt_status run_elementwise(int64_t M, int64_t C, int64_t F) {
    float *x = malloc(sizeof(float) * (size_t)(M * F)),
          *y = malloc(sizeof(float) * (size_t)(M * F));
    float *mod = malloc(sizeof(float) * (size_t)(2 * C));
    mdt_status st = MDT_OK;
    if (!x || !y || !mod)
        st = MDT_FAIL(MDT_E_NOMEM, "calibrate: out of memory for [%lld, %lld] rows", (long long)M,
                      (long long)F);
    if (st == MDT_OK) {
        fill_random(x, M * F, 5), fill_random(mod, 2 * C, 6);
        for (int r = 0; r < REPS; r++) {
            mdt_k()->layernorm_modulate(x, y, M, C, 1e-6f, mod, mod + C); // [M, C]
            mdt_k()->gelu_rows(y, F, M, F);                               // [M, F]
            mdt_k()->gate_residual(x, y, C, mod, M, C);                   // [M, C]
        }
    }
    free(x), free(y), free(mod);
    return st;
}

/* Sustained rates of this rank's kernels: FLOP/s of linear, attention, other. */
static mdt_status measure_compute(const mdt_model *m, int64_t S, int world, double rate[3]) {
    const mdt_model_dims md = mdt_model_dims_of(m);
    const int64_t heads = md.heads, hd = md.head_dim, C = md.hidden;
    /* a CP rank's rows, at most 4096: the rate, not the whole sum, is wanted, and a long
     * sequence must not make the probe hold what the run spreads over many ranks */
    const int64_t rows = (S + world - 1) / world, M = rows < 4096 ? rows : 4096;
    /* attention: at most 4 heads, 1024 queries and 16384 keys */
    const int64_t H = heads < 4 ? heads : 4, Sq = M < 1024 ? M : 1024, Sk = S < 16384 ? S : 16384;
    mdt_counters *c = mdt_counters_get();
    const mdt_counters before = *c;
    double pass[3][PASSES];
    mdt_status st = MDT_OK;
    /* the median of PASSES passes: a machine shared with others has moments it is not itself */
    for (int p = 0; p < PASSES && st == MDT_OK; p++) {
        const mdt_counters at = *c;
        st = run_linears(m, M);
        if (st == MDT_OK)
            st = run_attention(H, Sq, Sk, hd);
        if (st == MDT_OK)
            st = run_elementwise(M, C, 4 * C);
        for (int k = 0; k < 3; k++) {
            const double f = c->flops[k] - at.flops[k], s = c->seconds[k] - at.seconds[k];
            pass[k][p] = s > 0 ? f / s : 0;
        }
    }
    for (int k = 0; k < 3 && st == MDT_OK; k++)
        rate[k] = mdt_median(pass[k], PASSES);
    /* the calibration's kernels are not the run's: leave the counters as they were */
    *c = before;
    return st;
}

/* ---- links ---- */

static uint64_t host_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* 1: every member of group g shares this rank's host; 2: every member is on another host than
 * every other; 0: mixed. Collective over the group. */
static mdt_status group_kind(mdt_mesh *mesh, mdt_group g, int *kind) {
    const int n = mdt_group_size(mesh, g);
    int64_t *all = calloc((size_t)n, sizeof *all);
    if (!all)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    /* the low 62 bits: a hash the int64 exchange carries unchanged */
    const mdt_status st = mdt_allgather_i64(mesh, g, (int64_t)(host_hash(mesh->host) >> 2), all);
    int same = 1, distinct = 1;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            same &= all[i] == all[j], distinct &= i == j || all[i] != all[j];
    free(all);
    *kind = same ? 1 : distinct ? 2 : 0;
    return st;
}

/* One call of collective `kind` over `g` with `n` floats per member block. */
static mdt_status one_call(mdt_mesh *mesh, mdt_coll_cost_kind kind, mdt_group g, float *a, float *b,
                           int64_t n, int64_t *cnt) {
    const int G = mdt_group_size(mesh, g);
    switch (kind) {
    case MDT_COST_ALLREDUCE: return mdt_allreduce_sum(mesh, g, a, n * G);
    case MDT_COST_ALLGATHER: return mdt_allgather_floats(mesh, g, a, b, n);
    case MDT_COST_SENDRECV: {
        mdt_ring_req rq;
        MDT_TRY(mdt_ring_start(mesh, g, a, b, n * G, &rq));
        return mdt_ring_wait(mesh, &rq);
    }
    default: {
        int64_t *sc = cnt, *sd = cnt + G;
        for (int i = 0; i < G; i++)
            sc[i] = n, sd[i] = i * n;
        return mdt_alltoallv_floats(mesh, g, a, sc, sd, b, sc, sd);
    }
    }
}

/* Floats per member of the large probe at least (1 MiB): a small model's own messages take less
 * time than the jitter of ranks sharing cores, and the bandwidth is the slope between the two
 * sizes, so the large one must take many times the small one's jitter (8 ms across 1 Gbit/s). */
enum { LINK_PROBE_MIN = 262144 };

/* Lines every rank up for a timed call, within microseconds: the first watched barrier absorbs
 * the ranks' different arrivals (its waiters nap, and leave up to a nap apart); every rank then
 * reaches the second within a nap, so it completes inside mdt_mesh_wait's first millisecond of
 * tight testing and all leave together — still watched (deadline, failure notes). Two TCP flows
 * that cross a shaped link started apart often settle at half its rate (docs/perf.md), which the
 * forward's ring steps do not: the probe would measure the start, not the link. */
static mdt_status tight_start(mdt_mesh *mesh) {
    MDT_TRY(mdt_mesh_barrier(mesh, "calibration"));
    return mdt_mesh_barrier(mesh, "calibration");
}

/* The fraction of a ring transfer of n floats per member (t_comm seconds alone) that hides behind
 * compute started after it, as the ring's next block hides behind the attention of this one:
 * start, GEMMs for about t_comm with the transfer moved along as often as the ring's attention
 * moves it, wait; against the GEMMs alone. This rank's view. */
static mdt_status measure_overlap(mdt_mesh *mesh, mdt_group g, float *a, float *b, int64_t n,
                                  double t_comm, double *overlap) {
    enum { E = 128, OREPS = 5 };
    float *x = malloc(sizeof(float) * 3 * E * E); // [3, E, E]: x, w, y
    if (!x)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    fill_random(x, 3 * E * E, 8);
    const mdt_counters before = *mdt_counters_get();
    double t0 = mdt_now();
    for (int i = 0; i < 8; i++)
        mdt_k()->linear(x, E, x + E * E, NULL, NULL, x + 2 * E * E, E, E, E, E); // [E, E]
    const double one = (mdt_now() - t0) / 8;
    const int64_t k = one > 0 ? (int64_t)fmin(1e6, ceil(t_comm / one)) : 1;
    const int64_t poll = MDT_RING_POLL_FLOPS / (2 * E * E * E) + 1; /* GEMMs between moves */
    double tc[OREPS], tb[OREPS];
    mdt_status st = MDT_OK;
    for (int r = 0; r < OREPS && st == MDT_OK; r++) {
        t0 = mdt_now();
        for (int64_t i = 0; i < k; i++)
            mdt_k()->linear(x, E, x + E * E, NULL, NULL, x + 2 * E * E, E, E, E, E);
        tc[r] = mdt_now() - t0;
        if ((st = tight_start(mesh)) != MDT_OK)
            break;
        mdt_ring_req rq;
        t0 = mdt_now();
        if ((st = mdt_ring_start(mesh, g, a, b, n, &rq)) != MDT_OK)
            break;
        int pending = !mdt_ring_progress(mesh, &rq); /* as the ring's attention moves it */
        for (int64_t i = 0; i < k; i++) {
            mdt_k()->linear(x, E, x + E * E, NULL, NULL, x + 2 * E * E, E, E, E, E);
            if (pending && (i + 1) % poll == 0)
                pending = !mdt_ring_progress(mesh, &rq);
        }
        st = mdt_ring_wait(mesh, &rq);
        tb[r] = mdt_now() - t0;
    }
    *mdt_counters_get() = before;
    free(x);
    if (st == MDT_OK) {
        const double c = mdt_median(tc, OREPS), both = mdt_median(tb, OREPS);
        *overlap = fmax(0.0, fmin(1.0, (c + t_comm - both) / fmin(c, t_comm)));
    }
    return st;
}

/* Latency and bandwidth of `kind` over group g (the slowest rank's medians at two sizes); for
 * send/recv also how much of a transfer hides behind compute (the least any rank sees). */
static mdt_status measure_link(mdt_mesh *mesh, mdt_coll_cost_kind kind, mdt_group g, int64_t big,
                               mdt_link_cost *out) {
    static const mdt_coll_kind counted[] = {MDT_COLL_ALLREDUCE, MDT_COLL_ALLTOALL,
                                            MDT_COLL_SENDRECV, MDT_COLL_ALLGATHER};
    const int G = mdt_group_size(mesh, g);
    /* floats per member block: a small message, and the forward's own (`big` per call; at least
     * LINK_PROBE_MIN) */
    /* the all-reduce of more than two members takes MPI's tree below the ring's chunk threshold
     * (comm/mesh.c): both probes at or above it, so the fit describes one algorithm, the ring that
     * carries the forward's large all-reduces */
    const int64_t small = kind == MDT_COST_ALLREDUCE && G > 2 ? 16384 : 64;
    const int64_t sizes[2] = {small, big / G > LINK_PROBE_MIN ? big / G : LINK_PROBE_MIN};
    float *a = malloc(sizeof(float) * (size_t)(sizes[1] * G)),
          *b = malloc(sizeof(float) * (size_t)(sizes[1] * G));
    int64_t *cnt = malloc(sizeof(int64_t) * (size_t)(2 * G));
    double t[2] = {0, 0}, bytes[2] = {0, 0};
    mdt_status st = a && b && cnt ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (st == MDT_OK)
        fill_random(a, sizes[1] * G, 7);
    for (int z = 0; z < 2 && st == MDT_OK; z++) {
        const int reps = z == 0 ? 20 : 6;
        double ts[20];
        st = one_call(mesh, kind, g, a, b, sizes[z], cnt); /* warm-up */
        for (int r = 0; r < reps && st == MDT_OK; r++) {
            if ((st = tight_start(mesh)) != MDT_OK)
                break;
            const int64_t b0 = mesh->bytes_sent[counted[kind]];
            const double t0 = mdt_now();
            st = one_call(mesh, kind, g, a, b, sizes[z], cnt);
            ts[r] = mdt_now() - t0;
            bytes[z] = (double)(mesh->bytes_sent[counted[kind]] - b0);
        }
        if (st == MDT_OK)
            t[z] = mdt_median(ts, reps);
    }
    double hide = 1.0;
    if (st == MDT_OK && kind == MDT_COST_SENDRECV)
        st = measure_overlap(mesh, g, a, b, sizes[1] * G, t[1], &hide);
    free(a), free(b), free(cnt);
    st = mdt_mesh_agree(mesh, st);
    if (st != MDT_OK)
        return st;
    double least = 0;
    if (MPI_Allreduce(&hide, &least, 1, MPI_DOUBLE, MPI_MIN, mesh->world) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "calibrate: MPI_Allreduce failed");
    out->overlap = kind == MDT_COST_SENDRECV ? least : 0;
    double mx[2];
    if (MPI_Allreduce(t, mx, 2, MPI_DOUBLE, MPI_MAX, mesh->world) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "calibrate: MPI_Allreduce failed");
    const double dt = mx[1] - mx[0], db = bytes[1] - bytes[0];
    out->bw = dt > 0 && db > 0 ? db / dt : bytes[1] / mx[1];
    out->latency = fmax(0.0, mx[0] - bytes[0] / out->bw);
    return MDT_OK;
}

/* The meshes that put one axis inside a host (innermost, degree n) or across hosts (outermost,
 * degree H), and what each measures there. */
static mdt_status measure_links(int n, int H, const int64_t big[MDT_COST_KIND_COUNT],
                                mdt_device_spec *d, int *measured, int *end_job) {
    static const struct {
        mdt_axis axis;
        mdt_group group;
        mdt_coll_cost_kind kind;
        const char *inner, *outer; /* mesh orders (outermost first) */
    } k_probe[] = {
        {MDT_AXIS_TP, MDT_GROUP_TP, MDT_COST_ALLREDUCE, "ring,ulysses,tp", "tp,ulysses,ring"},
        {MDT_AXIS_ULYSSES, MDT_GROUP_ULYSSES, MDT_COST_ALLTOALL, "tp,ring,ulysses",
         "ulysses,ring,tp"},
        {MDT_AXIS_ULYSSES, MDT_GROUP_CP, MDT_COST_ALLGATHER, "tp,ring,ulysses", "ulysses,ring,tp"},
        {MDT_AXIS_RING, MDT_GROUP_RING, MDT_COST_SENDRECV, "tp,ulysses,ring", "ring,ulysses,tp"},
    };
    for (size_t p = 0; p < sizeof k_probe / sizeof k_probe[0]; p++)
        for (int inner = 1; inner >= 0; inner--) {
            const int deg = inner ? n : H, other = n * H / deg;
            if (deg < 2)
                continue;
            /* the probed axis gets `deg`; the rest goes to ring (TP probe) or tp */
            int dims[MDT_AXIS_COUNT] = {1, 1, 1, 1};
            dims[k_probe[p].axis] = deg;
            dims[k_probe[p].axis == MDT_AXIS_TP ? MDT_AXIS_RING : MDT_AXIS_TP] = other;
            mdt_mesh *mesh = NULL;
            const mdt_layout lay = {dims[MDT_AXIS_CFG], dims[MDT_AXIS_TP], dims[MDT_AXIS_RING],
                                    dims[MDT_AXIS_ULYSSES],
                                    inner ? k_probe[p].inner : k_probe[p].outer};
            MDT_TRY(mdt_mesh_create_world(&lay, &mesh));
            mdt_mesh_set_deadline(mesh, 120.0);
            int kind = 0;
            mdt_status st = mdt_mesh_agree(mesh, group_kind(mesh, k_probe[p].group, &kind));
            /* every rank must see the same kind of group (all inside, or all across, hosts) */
            int64_t v = kind, neg = -kind;
            if (st == MDT_OK)
                st = mdt_mesh_min_i64(mesh, &v, "calibration");
            if (st == MDT_OK)
                st = mdt_mesh_min_i64(mesh, &neg, "calibration");
            if (st == MDT_OK && v != 0 && v == -neg) {
                const int link = v == 1 ? MDT_LINK_INTRA : MDT_LINK_INTER;
                st = measure_link(mesh, k_probe[p].kind, k_probe[p].group, big[k_probe[p].kind],
                                  &d->coll[link][k_probe[p].kind]);
                *measured |= 1 << link;
            }
            *end_job = st != MDT_OK && mdt_mesh_peers_stuck(mesh);
            mdt_mesh_free(mesh);
            MDT_TRY(st);
        }
    return MDT_OK;
}

/* "model name" of /proc/cpuinfo, or "cpu". */
static void cpu_name(char *buf, size_t cap) {
    FILE *fp = fopen("/proc/cpuinfo", "r");
    char line[256];
    snprintf(buf, cap, "cpu");
    while (fp && fgets(line, sizeof line, fp)) {
        char *c = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && c) {
            c += strspn(c + 1, " \t") + 1;
            c[strcspn(c, "\n")] = 0;
            snprintf(buf, cap, "%s", c);
            break;
        }
    }
    if (fp)
        fclose(fp);
}

mdt_status mdt_calibrate(const mdt_model_info *info, int64_t tokens, mdt_device_spec *out,
                         int *end_job) {
    memset(out, 0, sizeof *out);
    *end_job = 0;
    if (tokens < 1 || tokens > ((int64_t)1 << 24))
        return MDT_FAIL(MDT_E_INVALID, "calibrate: tokens %lld outside [1, 2^24]",
                        (long long)tokens);
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    mdt_mesh *mesh = NULL;
    /* placement and agreement */
    MDT_TRY(mdt_mesh_create_world(&(mdt_layout){1, 1, world, 1, NULL}, &mesh));
    const int n = mesh->node_size;
    int64_t nmin = n, nmax = -n;
    mdt_status st = mdt_mesh_min_i64(mesh, &nmin, "calibration");
    if (st == MDT_OK)
        st = mdt_mesh_min_i64(mesh, &nmax, "calibration");
    if (st == MDT_OK && nmin != -nmax)
        st = MDT_FAIL(MDT_E_INVALID,
                      "calibrate: hosts run %lld to %lld ranks; launch the same number on each",
                      (long long)nmin, (long long)-nmax);
    /* memory per device: the smallest host's available memory over its ranks */
    const mdt_device *dflt = mdt_device_preset("cpu");
    char what[64];
    const int64_t avail = mdt_mem_available("", what, sizeof what);
    int64_t share = avail > 0 ? avail / n : (int64_t)dflt->mem_bytes;
    if (st == MDT_OK)
        st = mdt_mesh_min_i64(mesh, &share, "calibration");
    double rate[3] = {0, 0, 0}, slow[3] = {0, 0, 0};
    if (st == MDT_OK && (st = mdt_mesh_barrier(mesh, "calibration")) == MDT_OK)
        st = measure_compute(info->m, tokens, world, rate);
    st = mdt_mesh_agree(mesh, st);
    if (st == MDT_OK) {
        for (int k = 0; k < 3; k++)
            rate[k] = -rate[k];
        if (MPI_Allreduce(rate, slow, 3, MPI_DOUBLE, MPI_MAX, mesh->world) != MPI_SUCCESS)
            st = MDT_FAIL(MDT_E_MPI, "calibrate: MPI_Allreduce failed");
    }
    char host[64], cpu[96], date[32] = "";
    snprintf(host, sizeof host, "%s", mesh->host);
    *end_job = st != MDT_OK && mdt_mesh_peers_stuck(mesh);
    mdt_mesh_free(mesh);
    MDT_TRY(st);
    mdt_device_spec d = {0};
    d.flops = -slow[0], d.flops_attn = -slow[1], d.flops_other = -slow[2];
    if (!(d.flops > 0))
        return MDT_FAIL(MDT_E_UNSUPPORTED, "calibrate: the model has no linear to time");
    int measured = 0;
    /* the large message of each collective is the forward's at this size (a CP rank's rows, one
     * rank per head group): a TP all-reduce of [rows, hidden], a Ulysses all-to-all of q, k or v
     * [rows, heads x head_dim], a ring step's K and V, the output gather; at most 64 MiB */
    const mdt_model *mm = info->m;
    const mdt_model_dims md = mdt_model_dims_of(mm);
    const int64_t rows = (tokens + world - 1) / world, A = md.heads * md.head_dim, C = md.hidden;
    int64_t big[MDT_COST_KIND_COUNT] = {rows * C, rows * A, 2 * rows * A, rows * C};
    for (int k = 0; k < MDT_COST_KIND_COUNT; k++)
        big[k] = big[k] < ((int64_t)1 << 24) ? big[k] : ((int64_t)1 << 24);
    MDT_TRY(measure_links(n, world / n, big, &d, &measured, end_job));
    for (int l = 0; l < MDT_LINK_COUNT; l++) { /* flat figures: the link's all-to-all */
        const mdt_link_cost *a = &d.coll[l][MDT_COST_ALLTOALL], *b = &d.coll[!l][MDT_COST_ALLTOALL];
        const double bw = a->bw > 0 ? a->bw : b->bw > 0 ? b->bw : dflt->bw_intra;
        *(l == MDT_LINK_INTRA ? &d.bw_intra : &d.bw_inter) = bw;
    }
    const mdt_link_cost *lat = d.coll[MDT_LINK_INTER][MDT_COST_ALLTOALL].bw > 0
                                   ? &d.coll[MDT_LINK_INTER][MDT_COST_ALLTOALL]
                                   : &d.coll[MDT_LINK_INTRA][MDT_COST_ALLTOALL];
    d.latency = lat->bw > 0 ? lat->latency : dflt->latency;
    d.mem_bytes = (double)share;
    d.node_size = n;
    d.calibrated = 1;
    cpu_name(cpu, sizeof cpu);
    const time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm))
        strftime(date, sizeof date, "%Y-%m-%d", &tm);
    snprintf(d.name, sizeof d.name, "%s", host);
    snprintf(d.source, sizeof d.source,
             "plan --calibrate %s: %d ranks, %d host%s x %d, %lld tokens; %s; links measured: %s",
             date, world, world / n, world / n > 1 ? "s" : "", n, (long long)tokens, cpu,
             measured == 3   ? "intra, inter"
             : measured == 1 ? "intra"
             : measured == 2 ? "inter"
                             : "none");
    *out = d;
    return MDT_OK;
}
