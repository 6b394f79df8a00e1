/*
 * mesh.c — see mesh.h. Rank layout: with order (a0, a1, a2) outermost first and degrees
 * (d0, d1, d2), rank = c0 d1 d2 + c1 d2 + c2. Sub-communicators come from MPI_Comm_split with
 * colour = the other coordinates and key = the coordinate along the axis, so a rank's position
 * inside each group is its mesh coordinate.
 */
#define _POSIX_C_SOURCE 200809L
#include "mesh.h"

#include "core/testhooks.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *const k_axis_names[MDT_AXIS_COUNT] = {"tp", "ring", "ulysses", "cfg"};

const char *mdt_coll_kind_name(mdt_coll_kind k) {
    static const char *const n[MDT_COLL_KIND_COUNT] = {"allreduce", "allgather", "alltoall",
                                                       "sendrecv", "bcast"};
    return (unsigned)k < MDT_COLL_KIND_COUNT ? n[k] : "?";
}

mdt_status mdt_mesh_parse_order(const char *s, mdt_axis order[MDT_AXIS_COUNT]) {
    int seen[MDT_AXIS_COUNT] = {0}, n = 0;
    mdt_axis got[MDT_AXIS_COUNT];
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        int found = -1;
        for (int a = 0; a < MDT_AXIS_COUNT; a++)
            if (strlen(k_axis_names[a]) == len && strncmp(p, k_axis_names[a], len) == 0)
                found = a;
        if (found < 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "--mesh-order '%s': unknown axis '%.*s' (use cfg, tp, ring, "
                            "ulysses)",
                            s, (int)len, p);
        if (seen[found]++ || n == MDT_AXIS_COUNT)
            return MDT_FAIL(MDT_E_INVALID, "--mesh-order '%s': axis '%s' appears twice", s,
                            k_axis_names[found]);
        got[n++] = (mdt_axis)found;
        p = e ? e + 1 : p + len;
        if (e && !*p)
            return MDT_FAIL(MDT_E_INVALID, "--mesh-order '%s': ends with a comma", s);
    }
    const int cfg_implied = n == MDT_AXIS_COUNT - 1 && !seen[MDT_AXIS_CFG];
    if (n != MDT_AXIS_COUNT && !cfg_implied)
        return MDT_FAIL(MDT_E_INVALID,
                        "--mesh-order '%s' must name all of tp, ring, ulysses (and cfg, else it "
                        "is outermost)",
                        s);
    int k = 0;
    if (cfg_implied)
        order[k++] = MDT_AXIS_CFG;
    for (int i = 0; i < n; i++)
        order[k++] = got[i];
    return MDT_OK;
}

void mdt_mesh_order_str(const mdt_axis order[MDT_AXIS_COUNT], char *buf, size_t cap) {
    if (order[0] == MDT_AXIS_CFG) /* outermost, as the parser implies when it is left out */
        snprintf(buf, cap, "%s,%s,%s", k_axis_names[order[1]], k_axis_names[order[2]],
                 k_axis_names[order[3]]);
    else
        snprintf(buf, cap, "%s,%s,%s,%s", k_axis_names[order[0]], k_axis_names[order[1]],
                 k_axis_names[order[2]], k_axis_names[order[3]]);
}

void mdt_mesh_coords(int rank, const mdt_layout *l, const mdt_axis order[MDT_AXIS_COUNT],
                     mdt_coords *out) {
    const int deg[MDT_AXIS_COUNT] = {l->tp, l->ring, l->ulysses, l->cfg};
    int c[MDT_AXIS_COUNT] = {0}, rem = rank;
    for (int i = MDT_AXIS_COUNT - 1; i >= 0; i--) { /* innermost varies fastest */
        c[order[i]] = rem % deg[order[i]];
        rem /= deg[order[i]];
    }
    *out = (mdt_coords){.cfg = c[MDT_AXIS_CFG],
                        .tp = c[MDT_AXIS_TP],
                        .ring = c[MDT_AXIS_RING],
                        .ulysses = c[MDT_AXIS_ULYSSES]};
}

static mdt_status mpi_check(int rc, const char *what) {
    if (rc == MPI_SUCCESS)
        return MDT_OK;
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, s, &len);
    return MDT_FAIL(MDT_E_MPI, "%s failed: %s", what, s);
}

static mdt_status split(MPI_Comm world, int colour, int key, MPI_Comm *out) {
    MDT_TRY(mpi_check(MPI_Comm_split(world, colour, key, out), "MPI_Comm_split"));
    return mpi_check(MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
}

static void mesh_free_comms(mdt_mesh *m) {
    MPI_Comm *cs[] = {&m->tp, &m->ring,  &m->ulysses, &m->cfg,
                      &m->cp, &m->watch, &m->agree,   &m->world};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        if (*cs[i] != MPI_COMM_NULL)
            MPI_Comm_free(cs[i]);
}

/* This rank's host name and its rank among the ranks sharing the host's memory. */
static mdt_status placement(mdt_mesh *m) {
    MPI_Comm node;
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    if (MPI_Get_processor_name(name, &len) != MPI_SUCCESS)
        len = 0;
    snprintf(m->host, sizeof m->host, "%.*s", len, name);
    MDT_TRY(mpi_check(
        MPI_Comm_split_type(m->world, MPI_COMM_TYPE_SHARED, m->world_rank, MPI_INFO_NULL, &node),
        "MPI_Comm_split_type"));
    MPI_Comm_rank(node, &m->node_rank);
    MPI_Comm_size(node, &m->node_size);
    return mpi_check(MPI_Comm_free(&node), "MPI_Comm_free");
}

mdt_status mdt_mesh_create_comm(MPI_Comm world, const mdt_layout *l, mdt_mesh **out) {
    mdt_status st;
    *out = NULL;
    mdt_mesh *m = mdt_calloc(sizeof *m);
    if (!m)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    m->world = m->tp = m->ring = m->ulysses = m->cfg = m->cp = m->watch = m->agree = MPI_COMM_NULL;
    m->note_rank = -1;
    const int C = l->cfg, T = l->tp, R = l->ring, U = l->ulysses;
    MDT_CHECK(mdt_mesh_parse_order(l->order ? l->order : "cfg,tp,ring,ulysses", m->order));
    MDT_CHECK(mpi_check(MPI_Comm_dup(world, &m->world), "MPI_Comm_dup"));
    MDT_CHECK(mpi_check(MPI_Comm_set_errhandler(m->world, MPI_ERRORS_RETURN), "errhandler"));
    MDT_CHECK(mpi_check(MPI_Comm_dup(world, &m->watch), "MPI_Comm_dup"));
    MDT_CHECK(mpi_check(MPI_Comm_dup(m->world, &m->agree), "MPI_Comm_dup"));
    MDT_CHECK(mpi_check(MPI_Comm_set_errhandler(m->watch, MPI_ERRORS_RETURN), "errhandler"));
    MPI_Comm_size(m->world, &m->world_size);
    MPI_Comm_rank(m->world, &m->world_rank);
    if (C < 1 || T < 1 || R < 1 || U < 1)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                           "cfg, tp, ring and ulysses must be >= 1 (got %d, %d, %d, %d)", C, T, R,
                           U));
    if (C > 2)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                           "cfg=%d: the cfg axis has two groups at most (the conditional and "
                           "the unconditional branch, or two halves of a batch)",
                           C));
    if ((int64_t)C * T * R * U != m->world_size)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                           "layout %stp=%d x ring=%d x ulysses=%d needs %lld ranks, but %d were "
                           "launched",
                           C > 1 ? "cfg=2 x " : "", T, R, U, (long long)C * T * R * U,
                           m->world_size));
    m->C = C, m->T = T, m->R = R, m->U = U;
    mdt_coords co;
    mdt_mesh_coords(m->world_rank, l, m->order, &co);
    m->c = co.cfg, m->t = co.tp, m->r = co.ring, m->u = co.ulysses;
    m->cp_size = R * U;
    m->cp_index = m->r * U + m->u;
    m->member_i64_n = MDT_MESH_MEMBER_I64 * (int64_t)(T > R * U ? T : R * U);
    m->member_i64 = mdt_alloc(sizeof(int64_t) * (size_t)m->member_i64_n);
    if (!m->member_i64)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    /* colour = the coordinates along the other axes, key = the coordinate along this one; the
     * groups of one forward stay inside one cfg group */
    const int inner = T * R * U, c0 = m->c * inner;
    MDT_CHECK(split(m->world, c0 + m->r * U + m->u, m->t, &m->tp));
    MDT_CHECK(split(m->world, c0 + m->t * U + m->u, m->r, &m->ring));
    MDT_CHECK(split(m->world, c0 + m->t * R + m->r, m->u, &m->ulysses));
    MDT_CHECK(split(m->world, (m->t * R + m->r) * U + m->u, m->c, &m->cfg));
    MDT_CHECK(split(m->world, m->c * T + m->t, m->cp_index, &m->cp));
    m->tp_shard_index = m->t;
    MDT_CHECK(placement(m));
    if (mdt_test_hooks_get()->shard_index_world)
        m->tp_shard_index = m->world_rank; /* test-only: reproduce the upstream Neuron bug */
    *out = m;
    return MDT_OK;
fail:
    mesh_free_comms(m);
    mdt_free(m->member_i64);
    mdt_free(m);
    return st;
}

mdt_status mdt_mesh_create_world(const mdt_layout *l, mdt_mesh **out) {
    return mdt_mesh_create_comm(MPI_COMM_WORLD, l, out);
}

/* ---- device buffers: host staging ---- */
static int on_device(const void *p) {
    const mdt_mem_source *d = mdt_mem_device();
    return d && p && d->is_device(p);
}

static void stage_free(float *p) {
    const mdt_mem_source *d = mdt_mem_device();
    if (d && d->host_free)
        d->host_free(p);
    else
        mdt_free(p);
}

/* Host buffer `i` (0: send side, 1: receive side) of at least n floats. */
static float *stage_buf(mdt_mesh *m, int i, int64_t n) {
    if (m->stage_floats[i] >= n)
        return m->stage[i];
    stage_free(m->stage[i]);
    const mdt_mem_source *d = mdt_mem_device();
    const size_t bytes = sizeof(float) * (size_t)(n > 0 ? n : 1);
    m->stage[i] = d && d->host_alloc ? d->host_alloc(bytes) : mdt_alloc(bytes);
    m->stage_floats[i] = m->stage[i] ? n : 0;
    if (!m->stage[i])
        (void)MDT_FAIL(MDT_E_NOMEM, "out of host memory for %lld bytes of collective staging",
                       (long long)bytes);
    return m->stage[i];
}

/* The host view of a send buffer of n floats (staged copy if it is device memory). */
static const float *stage_in(mdt_mesh *m, const float *p, int64_t n) {
    if (!on_device(p))
        return p;
    float *h = stage_buf(m, 0, n);
    if (h && n > 0)
        mdt_mem_device()->to_host(h, p, sizeof(float) * (size_t)n);
    return h;
}

/* Where a receive of n floats into p lands on the host (p itself if host memory). */
static float *stage_out(mdt_mesh *m, float *p, int64_t n) {
    return on_device(p) ? stage_buf(m, 1, n) : p;
}

/* Moves a staged receive to its device destination. */
static void stage_done(float *p, const float *h, int64_t n) {
    if (p != h && n > 0)
        mdt_mem_device()->to_device(p, h, sizeof(float) * (size_t)n);
}

mdt_status mdt_mesh_use_comm(mdt_mesh *m, const mdt_device_comm *ops) {
    mdt_status st = MDT_OK;
    if (!ops || !ops->comm_init)
        st = MDT_FAIL(MDT_E_UNSUPPORTED, "the device backend has no collective library");
    MDT_TRY(mdt_mesh_agree(m, st));
    m->dev_ops = ops;
    for (int g = 0; g < MDT_GROUP_COUNT && st == MDT_OK; g++) {
        const int P = mdt_group_size(m, (mdt_group)g), me = mdt_group_rank(m, (mdt_group)g);
        unsigned char id[128] = {0};
        if (P == 1)
            continue;
        if (me == 0 && ops->comm_id(id) != 0)
            st = MDT_FAIL(MDT_E_MPI, "NCCL: ncclGetUniqueId failed");
        st = mdt_mesh_agree(m, st);
        if (st != MDT_OK)
            break;
        st = mpi_check(MPI_Bcast(id, 128, MPI_BYTE, 0, mdt_mesh_comm(m, (mdt_group)g)),
                       "NCCL id broadcast");
        char err[256] = "";
        if (st == MDT_OK) {
            m->dev_comm[g] = ops->comm_init(P, id, me, err, sizeof err);
            if (!m->dev_comm[g])
                st = MDT_FAIL(MDT_E_MPI, "NCCL: %s group: %s", mdt_group_name((mdt_group)g), err);
        }
        st = mdt_mesh_agree(m, st);
    }
    return st;
}

void mdt_mesh_free(mdt_mesh *m) {
    if (!m)
        return;
    mesh_free_comms(m);
    mdt_free(m->scratch);
    for (int i = 0; i < 2; i++)
        stage_free(m->stage[i]);
    for (int g = 0; g < MDT_GROUP_COUNT; g++)
        if (m->dev_comm[g])
            m->dev_ops->comm_free(m->dev_comm[g]);
    mdt_free(m->member_i64);
    mdt_free(m);
}

int mdt_mesh_rank(const mdt_mesh *m) { return m ? m->world_rank : 0; }
int mdt_mesh_size(const mdt_mesh *m) { return m ? m->world_size : 1; }

/* The message already names the failing rank: "rank N: ..." at its start or after an outer
 * phase's prefix ("step 2 of 4: rank N: ..."). */
static int names_rank(const char *msg) {
    for (const char *p = msg; (p = strstr(p, "rank ")) != NULL; p += 5) {
        if (p != msg && (p - msg < 2 || p[-2] != ':' || p[-1] != ' '))
            continue;
        const char *d = p + 5;
        while (*d >= '0' && *d <= '9')
            d++;
        if (d > p + 5 && d[0] == ':' && d[1] == ' ')
            return 1;
    }
    return 0;
}

/* The request is completed by MPI_Test, or deliberately abandoned when the job is being ended. */
/* NOLINTBEGIN(clang-analyzer-optin.mpi.MPI-Checker) */
static mdt_status agree(mdt_mesh *m, mdt_status local, int64_t order) {
    if (!m || m->world_size == 1 || m->peers_stuck) /* stuck: the job is being ended */
        return local;
    m->agreements++;
    m->world_collectives++;
    if (local != MDT_OK)
        mdt_mesh_note_failure(m, local);
    /* the failure the ranks take: the lowest order, then the lowest rank */
    const int64_t P = m->world_size;
    const int64_t o = order < 0 ? 0 : order > INT32_MAX ? INT32_MAX : order;
    int64_t mine = local == MDT_OK ? INT64_MAX : o * P + m->world_rank;
    int64_t least = INT64_MAX;
    int done = 0;
    MPI_Request rq;
    if (MPI_Iallreduce(&mine, &least, 1, MPI_INT64_T, MPI_MIN, m->agree, &rq) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "failure agreement: MPI_Iallreduce failed");
    /* A healthy rank waits as long as its peers need (a slow load is not a failure). A failed
     * rank waits a bounded time: peers blocked inside a step's collective never arrive, and
     * then the caller must end the job (the command calls MPI_Abort; the library does not). */
    const double t0 = mdt_now();
    const char *tenv = getenv("MESHDIT_AGREE_TIMEOUT");
    const double timeout = tenv ? atof(tenv) : 20.0;
    const double bound = m->agree_wait_s > timeout ? m->agree_wait_s : timeout;
    while (!done) {
        if (MPI_Test(&rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return MDT_FAIL(MDT_E_MPI, "failure agreement: MPI_Test failed");
        if (done)
            break;
        if (local != MDT_OK && mdt_now() - t0 > bound) {
            m->peers_stuck = 1;
            return mdt_fail_prefix(local,
                                   "rank %d (the other ranks did not reach the failure "
                                   "agreement within %.0f s)",
                                   m->world_rank, bound);
        }
        m->waiting = 1;
        mdt_mesh_watch_serve(m);
        if (local == MDT_OK) {
            const mdt_status stop = mdt_mesh_check_stop(m, "failure agreement", 1);
            if (stop != MDT_OK)
                return stop;
        }
        if (local == MDT_OK && m->deadline_s > 0 && mdt_now() - t0 > m->deadline_s) {
            const mdt_status st = mdt_mesh_stalled(m, "failure agreement", mdt_now() - t0);
            m->waiting = 0;
            return st;
        }
        const struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    m->waiting = 0;
    mdt_mesh_poll_notes(m); /* rank 0: this agreement's notes are answered by it */
    if (least == INT64_MAX)
        return MDT_OK;
    const int first = (int)(least % P);
    struct {
        int code;
        char msg[1800];
    } pkt;
    memset(&pkt, 0, sizeof pkt);
    if (m->world_rank == first) {
        pkt.code = (int)local;
        mdt_fit_text(mdt_last_error(), pkt.msg, sizeof pkt.msg);
    }
    if (MPI_Bcast(&pkt, (int)sizeof pkt, MPI_BYTE, first, m->agree) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "failure agreement: MPI_Bcast failed");
    if (names_rank(pkt.msg)) /* already agreed on at an inner phase boundary */
        return MDT_FAIL((mdt_status)pkt.code, "%s", pkt.msg);
    return MDT_FAIL((mdt_status)pkt.code, "rank %d: %s", first, pkt.msg);
}
/* NOLINTEND(clang-analyzer-optin.mpi.MPI-Checker) */

mdt_status mdt_mesh_agree(mdt_mesh *m, mdt_status local) {
    return mdt_mesh_agree_ordered(m, local, 0);
}

mdt_status mdt_mesh_agree_ordered(mdt_mesh *m, mdt_status local, int64_t order) {
    const double t0 = mdt_now();
    const mdt_status s = agree(m, local, order);
    if (m && m->world_size > 1)
        m->wait_s[MDT_WAIT_WORLD] += mdt_now() - t0;
    return local != MDT_OK && s == MDT_OK ? local : s; /* never OK over a local failure */
}

mdt_status mdt_world_agree(mdt_status local) {
    int init = 0, P = 1, me = 0;
    if (MPI_Initialized(&init) != MPI_SUCCESS || !init)
        return local;
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    if (P == 1)
        return local;
    int first = local == MDT_OK ? INT_MAX : me;
    if (MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "agreement over the world: MPI_Allreduce failed");
    if (first == INT_MAX)
        return MDT_OK;
    struct {
        int code;
        char msg[1800];
    } pkt = {(int)local, ""};
    if (me == first)
        mdt_fit_text(mdt_last_error(), pkt.msg, sizeof pkt.msg);
    if (MPI_Bcast(&pkt, (int)sizeof pkt, MPI_BYTE, first, MPI_COMM_WORLD) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "agreement over the world: MPI_Bcast failed");
    if (strncmp(pkt.msg, "rank ", 5) == 0) /* already agreed on by the ranks that failed */
        return MDT_FAIL((mdt_status)pkt.code, "%s", pkt.msg);
    return MDT_FAIL((mdt_status)pkt.code, "rank %d: %s", first, pkt.msg);
}

const char *mdt_group_name(mdt_group g) {
    static const char *const n[MDT_GROUP_COUNT] = {"tp", "ring", "ulysses", "cfg", "cp"};
    return (unsigned)g < MDT_GROUP_COUNT ? n[g] : "?";
}

MPI_Comm mdt_mesh_comm(const mdt_mesh *m, mdt_group g) {
    switch (g) {
    case MDT_GROUP_TP: return m->tp;
    case MDT_GROUP_RING: return m->ring;
    case MDT_GROUP_ULYSSES: return m->ulysses;
    case MDT_GROUP_CFG: return m->cfg;
    case MDT_GROUP_CP: return m->cp;
    case MDT_GROUP_COUNT: break;
    }
    return MPI_COMM_NULL;
}

int mdt_group_size(const mdt_mesh *m, mdt_group g) {
    const int sz[MDT_GROUP_COUNT] = {m->T, m->R, m->U, m->C, m->cp_size};
    return (unsigned)g < MDT_GROUP_COUNT ? sz[g] : 1;
}

int mdt_group_rank(const mdt_mesh *m, mdt_group g) {
    const int rk[MDT_GROUP_COUNT] = {m->t, m->r, m->u, m->c, m->cp_index};
    return (unsigned)g < MDT_GROUP_COUNT ? rk[g] : 0;
}

static void count(mdt_mesh *m, mdt_group g, mdt_coll_kind k, int64_t bytes) {
    m->bytes_sent[k] += bytes;
    m->group_bytes[g] += bytes;
}

static mdt_status ensure_scratch(mdt_mesh *m, int64_t n) {
    if (m->scratch_floats >= n)
        return MDT_OK;
    mdt_free(m->scratch);
    m->scratch = mdt_alloc(sizeof(float) * (size_t)n);
    m->scratch_floats = m->scratch ? n : 0;
    return m->scratch ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory for collective scratch");
}

static int fits_int(int64_t n) { return n >= 0 && n <= INT_MAX; }

/* Chunks (floats per member) from which an all-reduce of more than two members takes the ring:
 * its 2 (P - 1) steps cost latency that a tree's 2 log P do not, and pay once each step moves at
 * least 64 KiB (two members always take it: one step each way) */
enum { RING_ALLREDUCE_MIN_CHUNK = 16384 };

/* One step of a ring collective: send n floats to the next member, receive n from the previous
 * one (tag 78: the ring attention's steps use 77 on their own communicator). */
static mdt_status ring_step(mdt_mesh *m, MPI_Comm comm, int P, int me, const float *send,
                            float *recv, int64_t n, const char *what) {
    MPI_Request rq[2];
    MDT_TRY(mpi_check(MPI_Irecv(recv, (int)n, MPI_FLOAT, (me + P - 1) % P, 78, comm, &rq[0]),
                      "all-reduce MPI_Irecv"));
    if (MPI_Isend(send, (int)n, MPI_FLOAT, (me + 1) % P, 78, comm, &rq[1]) != MPI_SUCCESS) {
        MPI_Cancel(&rq[0]);
        MPI_Request_free(&rq[0]);
        return MDT_FAIL(MDT_E_MPI, "all-reduce MPI_Isend failed");
    }
    return mdt_mesh_wait_in(m, MDT_COLL_ALLREDUCE, comm, 2, rq, what);
}

/* The bandwidth-optimal all-reduce (the ring NCCL uses) of full [P, chunk] in place, tmp [chunk]
 * scratch: P - 1 reduce-scatter steps (send chunk me - s on, add chunk me - s - 1 from the previous
 * member), after which this member holds chunk me + 1 summed over all, then P - 1 all-gather steps
 * passing the summed chunks on. Every member ends with the owner's bits of every chunk, so all
 * agree exactly. Each member sends 2 (P - 1) chunks and every link carries both directions at
 * once; Open MPI's non-blocking reduce-scatter moved the same bytes at a quarter of the link's
 * rate across hosts and MPICH's at a fifth of an all-gather's inside one (docs/perf.md). */
static mdt_status ring_allreduce(mdt_mesh *m, MPI_Comm comm, float *full, float *tmp, int64_t chunk,
                                 const char *what) {
    int P, me;
    MPI_Comm_size(comm, &P);
    MPI_Comm_rank(comm, &me);
    for (int s = 0; s < P - 1; s++) {
        const int out = (me - s + P) % P, in = (me - s - 1 + 2 * P) % P;
        MDT_TRY(ring_step(m, comm, P, me, full + out * chunk, tmp, chunk, what)); // tmp [chunk]
        float *acc = full + in * chunk;                                           // [chunk]
        for (int64_t i = 0; i < chunk; i++)
            acc[i] += tmp[i];
    }
    for (int s = 0; s < P - 1; s++) {
        const int out = (me + 1 - s + P) % P, in = (me - s + P) % P;
        MDT_TRY(ring_step(m, comm, P, me, full + out * chunk, full + in * chunk, chunk, what));
    }
    return MDT_OK;
}

mdt_status mdt_allreduce_sum(mdt_mesh *m, mdt_group g, float *buf, int64_t n) {
    const int P = mdt_group_size(m, g);
    MPI_Comm comm = mdt_mesh_comm(m, g);
    if (P == 1 || n == 0)
        return MDT_OK;
    const int64_t chunk = (n + P - 1) / P, padded = chunk * P;
    if (!fits_int(chunk))
        return MDT_FAIL(MDT_E_UNSUPPORTED, "all-reduce of %lld floats is too large", (long long)n);
    const int dev = on_device(buf);
    if (dev && m->dev_comm[g]) {
        if (m->dev_ops->comm_allreduce(m->dev_comm[g], buf, n, P) != 0)
            return MDT_FAIL(MDT_E_MPI, "NCCL all-reduce over the %s group failed",
                            mdt_group_name(g));
        count(m, g, MDT_COLL_ALLREDUCE, 2 * (int64_t)(P - 1) * chunk * 4);
        return MDT_OK;
    }
    /* a host buffer that P divides is reduced in place (the same steps, no copy in and out) */
    const int inplace = !dev && padded == n;
    MDT_TRY(ensure_scratch(m, inplace ? chunk : padded + chunk));
    float *full = inplace ? buf : m->scratch, *mine = inplace ? m->scratch : m->scratch + padded;
    if (dev)
        mdt_mem_device()->to_host(full, buf, sizeof(float) * (size_t)n);
    else if (!inplace)
        memcpy(full, buf, sizeof(float) * (size_t)n);
    memset(full + n, 0, sizeof(float) * (size_t)(padded - n));
    char what[48];
    snprintf(what, sizeof what, "%s all-reduce", mdt_group_name(g));
    if (P == 2 || chunk >= RING_ALLREDUCE_MIN_CHUNK) {
        MDT_TRY(ring_allreduce(m, comm, full, mine, chunk, what));
    } else {
        MPI_Request rq;
        MDT_TRY(mpi_check(
            MPI_Ireduce_scatter_block(full, mine, (int)chunk, MPI_FLOAT, MPI_SUM, comm, &rq),
            "all-reduce (reduce-scatter)"));
        MDT_TRY(mdt_mesh_wait_in(m, MDT_COLL_ALLREDUCE, comm, 1, &rq, what));
        MDT_TRY(mpi_check(
            MPI_Iallgather(mine, (int)chunk, MPI_FLOAT, full, (int)chunk, MPI_FLOAT, comm, &rq),
            "all-reduce (all-gather)"));
        MDT_TRY(mdt_mesh_wait_in(m, MDT_COLL_ALLREDUCE, comm, 1, &rq, what));
    }
    if (dev)
        mdt_mem_device()->to_device(buf, full, sizeof(float) * (size_t)n);
    else if (!inplace)
        memcpy(buf, full, sizeof(float) * (size_t)n);
    count(m, g, MDT_COLL_ALLREDUCE, 2 * (int64_t)(P - 1) * chunk * 4);
    return MDT_OK;
}

mdt_status mdt_bcast_floats(mdt_mesh *m, mdt_group g, int root, float *buf, int64_t n) {
    const int P = mdt_group_size(m, g);
    if (P == 1)
        return MDT_OK;
    for (int64_t off = 0; off < n; off += INT_MAX / 2) {
        int c = (int)(n - off < INT_MAX / 2 ? n - off : INT_MAX / 2);
        MPI_Request rq;
        MDT_TRY(mpi_check(MPI_Ibcast(buf + off, c, MPI_FLOAT, root, mdt_mesh_comm(m, g), &rq),
                          "MPI_Bcast"));
        MDT_TRY(mdt_mesh_wait_in(m, MDT_COLL_BCAST, mdt_mesh_comm(m, g), 1, &rq, "broadcast"));
    }
    if (mdt_group_rank(m, g) == root)
        count(m, g, MDT_COLL_BCAST, n * 4);
    return MDT_OK;
}

mdt_status mdt_allgather_floats(mdt_mesh *m, mdt_group g, const float *send, float *recv,
                                int64_t n) {
    const int P = mdt_group_size(m, g);
    if (!fits_int(n))
        return MDT_FAIL(MDT_E_UNSUPPORTED, "all-gather of %lld floats is too large", (long long)n);
    const float *hs = stage_in(m, send, n);
    float *hr = stage_out(m, recv, n * P);
    if (!hs || !hr)
        return MDT_E_NOMEM;
    MPI_Request rq;
    MDT_TRY(mpi_check(
        MPI_Iallgather(hs, (int)n, MPI_FLOAT, hr, (int)n, MPI_FLOAT, mdt_mesh_comm(m, g), &rq),
        "MPI_Allgather"));
    MDT_TRY(mdt_mesh_wait_in(m, MDT_COLL_ALLGATHER, mdt_mesh_comm(m, g), 1, &rq, "all-gather"));
    stage_done(recv, hr, n * P);
    count(m, g, MDT_COLL_ALLGATHER, (int64_t)(P - 1) * n * 4);
    return MDT_OK;
}

enum { MAX_GROUP = 4096 };

mdt_status mdt_allgatherv_floats(mdt_mesh *m, mdt_group g, const float *send, float *recv,
                                 const int64_t *counts) {
    const int P = mdt_group_size(m, g), me = mdt_group_rank(m, g);
    int cnt[MAX_GROUP], dsp[MAX_GROUP];
    int64_t off = 0;
    if (P > MAX_GROUP)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "group of %d ranks is too large", P);
    for (int i = 0; i < P; i++) {
        if (!fits_int(counts[i]) || !fits_int(off))
            return MDT_FAIL(MDT_E_UNSUPPORTED, "all-gather of %lld floats is too large",
                            (long long)counts[i]);
        cnt[i] = (int)counts[i], dsp[i] = (int)off;
        off += counts[i];
    }
    const float *hs = stage_in(m, send, counts[me]);
    float *hr = stage_out(m, recv, off);
    if (!hs || !hr)
        return MDT_E_NOMEM;
    MPI_Request rq;
    MDT_TRY(mpi_check(
        MPI_Iallgatherv(hs, cnt[me], MPI_FLOAT, hr, cnt, dsp, MPI_FLOAT, mdt_mesh_comm(m, g), &rq),
        "MPI_Allgatherv"));
    MDT_TRY(mdt_mesh_wait_in(m, MDT_COLL_ALLGATHER, mdt_mesh_comm(m, g), 1, &rq, "all-gather"));
    stage_done(recv, hr, off);
    count(m, g, MDT_COLL_ALLGATHER, (int64_t)(P - 1) * counts[me] * 4);
    return MDT_OK;
}

mdt_status mdt_allgather_i64(mdt_mesh *m, mdt_group g, int64_t v, int64_t *all) {
    long long x = (long long)v;
    MPI_Request rq;
    MDT_TRY(mpi_check(
        MPI_Iallgather(&x, 1, MPI_LONG_LONG, all, 1, MPI_LONG_LONG, mdt_mesh_comm(m, g), &rq),
        "length exchange (MPI_Allgather)"));
    return mdt_mesh_wait_in(m, MDT_COLL_ALLGATHER, mdt_mesh_comm(m, g), 1, &rq, "length exchange");
}

mdt_status mdt_alltoallv_floats(mdt_mesh *m, mdt_group g, const float *send, const int64_t *scounts,
                                const int64_t *sdispls, float *recv, const int64_t *rcounts,
                                const int64_t *rdispls) {
    const int P = mdt_group_size(m, g), me = mdt_group_rank(m, g);
    int sc[MAX_GROUP], sd[MAX_GROUP], rc[MAX_GROUP], rd[MAX_GROUP];
    int64_t sent = 0, send_end = 0, recv_end = 0;
    if (P > MAX_GROUP)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "group of %d ranks is too large", P);
    for (int i = 0; i < P; i++) {
        send_end = sdispls[i] + scounts[i] > send_end ? sdispls[i] + scounts[i] : send_end;
        recv_end = rdispls[i] + rcounts[i] > recv_end ? rdispls[i] + rcounts[i] : recv_end;
        if (!fits_int(scounts[i]) || !fits_int(sdispls[i]) || !fits_int(rcounts[i]) ||
            !fits_int(rdispls[i]))
            return MDT_FAIL(MDT_E_UNSUPPORTED, "all-to-all block too large for MPI int counts");
        sc[i] = (int)scounts[i], sd[i] = (int)sdispls[i];
        rc[i] = (int)rcounts[i], rd[i] = (int)rdispls[i];
        if (i != me)
            sent += scounts[i];
    }
    if (on_device(send) && m->dev_comm[g]) {
        if (m->dev_ops->comm_alltoallv(m->dev_comm[g], P, send, scounts, sdispls, recv, rcounts,
                                       rdispls) != 0)
            return MDT_FAIL(MDT_E_MPI, "NCCL all-to-all over the %s group failed",
                            mdt_group_name(g));
        count(m, g, MDT_COLL_ALLTOALL, sent * 4);
        return MDT_OK;
    }
    const float *hs = stage_in(m, send, send_end);
    float *hr = stage_out(m, recv, recv_end);
    if (!hs || !hr)
        return MDT_E_NOMEM;
    MPI_Request rq;
    MDT_TRY(mpi_check(
        MPI_Ialltoallv(hs, sc, sd, MPI_FLOAT, hr, rc, rd, MPI_FLOAT, mdt_mesh_comm(m, g), &rq),
        "MPI_Alltoallv"));
    MDT_TRY(
        mdt_mesh_wait_in(m, MDT_COLL_ALLTOALL, mdt_mesh_comm(m, g), 1, &rq, "ulysses all-to-all"));
    stage_done(recv, hr, recv_end);
    count(m, g, MDT_COLL_ALLTOALL, sent * 4);
    return MDT_OK;
}

/* The MPI checker cannot follow a request from the start of a ring step to its wait in another
 * function; mdt_ring_wait completes every request mdt_ring_start makes. */
/* NOLINTBEGIN(clang-analyzer-optin.mpi.MPI-Checker) */
mdt_status mdt_ring_start(mdt_mesh *m, mdt_group g, const float *send, float *recv, int64_t n,
                          mdt_ring_req *rq) {
    const int P = mdt_group_size(m, g), me = mdt_group_rank(m, g);
    MPI_Comm comm = mdt_mesh_comm(m, g);
    rq->req[0] = rq->req[1] = MPI_REQUEST_NULL;
    rq->recv = recv, rq->host_recv = NULL, rq->n = n, rq->on_device_comm = 0, rq->group = g;
    if (!fits_int(n))
        return MDT_FAIL(MDT_E_UNSUPPORTED, "ring block of %lld floats is too large", (long long)n);
    if (on_device(send) && m->dev_comm[g]) {
        if (m->dev_ops->comm_sendrecv(m->dev_comm[g], send, (me + 1) % P, recv, (me + P - 1) % P,
                                      n) != 0)
            return MDT_FAIL(MDT_E_MPI, "NCCL ring send/recv over the %s group failed",
                            mdt_group_name(g));
        rq->on_device_comm = 1;
        count(m, g, MDT_COLL_SENDRECV, n * 4);
        return MDT_OK;
    }
    const float *hs = stage_in(m, send, n);
    float *hr = stage_out(m, recv, n);
    if (!hs || !hr)
        return MDT_E_NOMEM;
    rq->host_recv = hr;
    MDT_TRY(mpi_check(MPI_Irecv(hr, (int)n, MPI_FLOAT, (me + P - 1) % P, 77, comm, &rq->req[0]),
                      "ring MPI_Irecv"));
    MDT_TRY(mpi_check(MPI_Isend(hs, (int)n, MPI_FLOAT, (me + 1) % P, 77, comm, &rq->req[1]),
                      "ring MPI_Isend"));
    count(m, g, MDT_COLL_SENDRECV, n * 4);
    return MDT_OK;
}

mdt_status mdt_ring_wait(mdt_mesh *m, mdt_ring_req *rq) {
    if (rq->on_device_comm)
        return m->dev_ops->comm_wait(m->dev_comm[rq->group]) == 0
                   ? MDT_OK
                   : MDT_FAIL(MDT_E_MPI, "NCCL ring transfer failed");
    MDT_TRY(mdt_mesh_wait_in(m, MDT_COLL_SENDRECV, mdt_mesh_comm(m, rq->group), 2, rq->req,
                             "ring send/receive"));
    if (rq->host_recv)
        stage_done(rq->recv, rq->host_recv, rq->n);
    return MDT_OK;
}

int mdt_ring_progress(mdt_mesh *m, mdt_ring_req *rq) {
    (void)m;
    if (rq->on_device_comm)
        return 1;
    /* completed requests become MPI_REQUEST_NULL: mdt_ring_wait then sees them done */
    int done = 0;
    MPI_Status sts[2];
    return MPI_Testall(2, rq->req, &done, sts) == MPI_SUCCESS && done;
}
/* NOLINTEND(clang-analyzer-optin.mpi.MPI-Checker) */

int mdt_mesh_peers_stuck(const mdt_mesh *m) { return m ? m->peers_stuck : 0; }

mdt_status mdt_mesh_coords_of(const mdt_layout *l, int rank, mdt_coords *out) {
    mdt_axis ax[MDT_AXIS_COUNT];
    MDT_TRY(mdt_mesh_parse_order(l->order ? l->order : "cfg,tp,ring,ulysses", ax));
    mdt_mesh_coords(rank, l, ax, out);
    return MDT_OK;
}
