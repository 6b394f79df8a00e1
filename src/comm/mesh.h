/*
 * mesh.h — the device mesh over MPI: world = T x R x U ranks laid out in a configurable axis
 * order, one communicator per axis (TP, Ring, Ulysses) plus the CP-flattened group (ring-major,
 * c = r U + u), collectives that count the bytes they send per kind, and the failure agreement
 * that keeps ranks from hanging when one of them fails.
 *
 * Every shard index is a coordinate in a sub-communicator, never the world rank (the one
 * exception is the test-only shard_index_world hook (core/testhooks.h), which exists to prove the
 * tests catch that bug). Communicators use MPI_ERRORS_RETURN; failures come back as MDT_E_MPI.
 */
#ifndef MDT_MESH_H
#define MDT_MESH_H

#include "comm/device_comm.h"
#include "core/core.h"

#include <mpi.h>

/* The axes: TP, Ring and Ulysses inside one forward; cfg across forwards (the classifier-free
 * guidance branches of a step, or halves of its batch: each cfg group runs its own forward on
 * the whole tp x ring x ulysses layout). */
typedef enum mdt_axis {
    MDT_AXIS_TP = 0,
    MDT_AXIS_RING,
    MDT_AXIS_ULYSSES,
    MDT_AXIS_CFG,
    MDT_AXIS_COUNT
} mdt_axis;

/* The groups collectives run over: the four axes plus the CP-flattened group. */
typedef enum mdt_group {
    MDT_GROUP_TP = MDT_AXIS_TP,
    MDT_GROUP_RING = MDT_AXIS_RING,
    MDT_GROUP_ULYSSES = MDT_AXIS_ULYSSES,
    MDT_GROUP_CFG = MDT_AXIS_CFG,
    MDT_GROUP_CP,
    MDT_GROUP_COUNT
} mdt_group;
const char *mdt_group_name(mdt_group g);

typedef enum mdt_coll_kind {
    MDT_COLL_ALLREDUCE = 0,
    MDT_COLL_ALLGATHER,
    MDT_COLL_ALLTOALL,
    MDT_COLL_SENDRECV,
    MDT_COLL_BCAST,
    MDT_COLL_KIND_COUNT
} mdt_coll_kind;

const char *mdt_coll_kind_name(mdt_coll_kind k);

/* mdt_mesh.wait_s's buckets: one per collective kind, then the world's agreements. */
enum { MDT_WAIT_WORLD = MDT_COLL_KIND_COUNT, MDT_WAIT_BUCKETS };

enum { MDT_MESH_MEMBER_I64 = 9 };

struct mdt_mesh {
    MPI_Comm world, tp, ring, ulysses, cfg, cp;
    int world_size, world_rank;
    int C, T, R, U;                 /* degrees */
    int c, t, r, u;                 /* this rank's coordinates */
    int cp_size, cp_index;          /* R U, r U + u */
    mdt_axis order[MDT_AXIS_COUNT]; /* outermost first */
    int tp_shard_index;             /* = t (or the world rank under the test-only bug switch) */
    /* placement: this rank's host (MPI_Get_processor_name) and its rank among the ranks that
     * share the host's memory (MPI_COMM_TYPE_SHARED: the rank a device is picked with) */
    char host[64];
    int node_rank, node_size;
    int64_t bytes_sent[MDT_COLL_KIND_COUNT]; /* per kind, summed over groups */
    int64_t group_bytes[MDT_GROUP_COUNT];    /* per group, summed over kinds */
    int64_t world_collectives; /* calls over the whole world: agreements, barriers, min-reduces */
    /* seconds blocked waiting for collectives to complete, per kind, and (MDT_WAIT_WORLD) in the
     * world's agreements, barriers and min-reduces: the part of a collective the rank's compute
     * did not hide, transfer and waiting for late peers together (host MPI paths; a device
     * library's calls are asynchronous and not timed) */
    double wait_s[MDT_WAIT_BUCKETS];
    float *scratch;  /* collective scratch, grown on first use */
    int peers_stuck; /* a failure could not be agreed on: the job must be ended */
    /* a failed rank's wait for its peers in the failure agreement, when longer than
     * MESHDIT_AGREE_TIMEOUT's (0: that alone): set while the world's parts run different work
     * (two cfg groups' forwards), where a peer that is late is busy, not stuck */
    double agree_wait_s;
    /* step watchdog (watchdog.c): a collective or agreement that waits longer than
     * `deadline_s` (0: wait as long as it takes) is a stall; `watch` carries the side-channel
     * questions that find which ranks did not arrive. */
    double deadline_s;
    const char *deadline_opt; /* the option that sets it, named in the stall's line */
    MPI_Comm watch;
    /* the failure agreement's own communicator: a rank that failed between two collectives
     * agrees here, where no peer's compute collective can ever match its message */
    MPI_Comm agree;
    int waiting;       /* inside a watched wait (answers "waiting" to a question) */
    int interruptible; /* a stop request (mdt_mesh_request_stop) ends this mesh's waits */
    /* failure notes (watchdog.c): agreements started so far (the same count on every rank);
     * the note this rank sent when it failed (kept until the mesh is freed: the send is not
     * waited for); on rank 0, the note of a failed rank for the coming agreement (-1: none) */
    int64_t agreements;
    char note_out[1024];
    int note_rank, note_code;
    int64_t note_epoch;
    char note_msg[1024];
    int64_t scratch_floats;
    /* host scratch for callers' per-member sizes, counts and displacements (attn.c):
     * MDT_MESH_MEMBER_I64 arrays as long as the largest group, made with the mesh so no step
     * allocates them */
    int64_t *member_i64;
    int64_t member_i64_n;
    /* Device buffers (core's mdt_mem_device): staged through these host buffers and plain MPI
     * (the host-staged path: any number of ranks per GPU), or, once mdt_mesh_use_comm
     * succeeded, moved by the device library's communicators (NCCL), one per group. */
    float *stage[2];
    int64_t stage_floats[2];
    const mdt_device_comm *dev_ops;
    void *dev_comm[MDT_GROUP_COUNT];
};

/* Bootstraps one device communicator per group of size > 1 with the device library `dc` (NCCL,
 * from the loaded plugin: mdt_backend_device_comm; NULL: MDT_E_UNSUPPORTED): the group's member
 * 0 makes the unique id, MPI broadcasts it inside the group. Collective; same verdict on every
 * rank. */
mdt_status mdt_mesh_use_comm(mdt_mesh *m, const mdt_device_comm *dc);

/* Parses "cfg,tp,ring,ulysses" (any permutation; without cfg it is outermost) into order[4].
 * MDT_E_INVALID naming the bad axis. */
mdt_status mdt_mesh_parse_order(const char *s, mdt_axis order[MDT_AXIS_COUNT]);
/* The order as --mesh-order spells it into buf: "tp,ring,ulysses" when cfg is outermost (the
 * default it implies), else all four axes ("tp,cfg,ring,ulysses"). */
void mdt_mesh_order_str(const mdt_axis order[MDT_AXIS_COUNT], char *buf, size_t cap);
/* Coordinates of world rank `rank` in the mesh of `l` (its order parsed into `order`; pure, no
 * MPI). */
void mdt_mesh_coords(int rank, const mdt_layout *l, const mdt_axis order[MDT_AXIS_COUNT],
                     mdt_coords *out);

/* Builds the mesh of `l` over `world` (duplicated). Fails (same verdict on every rank) if the
 * product of the degrees differs from the world size, a degree is < 1, or cfg > 2. */
mdt_status mdt_mesh_create_comm(MPI_Comm world, const mdt_layout *l, mdt_mesh **out);

/* Phase-boundary agreement (meshdit.h: mdt_mesh_agree): every rank passes its local status; if
 * any rank failed, every rank returns that failure with the lowest failing rank's message ("rank
 * k: ..."). Collective over the world communicator. A failed rank whose peers do not arrive
 * within MESHDIT_AGREE_TIMEOUT seconds (default 20: they are blocked in a collective of a step it
 * left; m->agree_wait_s when longer) returns its own failure with m->peers_stuck set; the caller
 * must then end the job (MPI_Abort). Never MDT_OK when `local` is not. */
mdt_status mdt_mesh_agree(mdt_mesh *m, mdt_status local);
/* The same, where failures have an order (>= 0; mdt_mesh_agree's is 0 for all): the ranks take
 * the message of the failure with the lowest order, of the lowest rank among those (a forward's
 * earliest stage that went non-finite, whichever rank saw it). */
mdt_status mdt_mesh_agree_ordered(mdt_mesh *m, mdt_status local, int64_t order);

/* The communicator of a group. */
MPI_Comm mdt_mesh_comm(const mdt_mesh *m, mdt_group g);
/* Size of a group and this rank's position in it (its coordinate). */
int mdt_group_size(const mdt_mesh *m, mdt_group g);
int mdt_group_rank(const mdt_mesh *m, mdt_group g);

/* In-place sum over group g whose result is bit-identical on every member: each element is
 * reduced by exactly one rank (reduce-scatter) and then copied to all (all-gather) — over a ring
 * of point-to-point steps for two members or large messages (bandwidth-optimal), else MPI's. */
mdt_status mdt_allreduce_sum(mdt_mesh *m, mdt_group g, float *buf, int64_t n);
/* Broadcast of n floats from member `root` of group g. */
mdt_status mdt_bcast_floats(mdt_mesh *m, mdt_group g, int root, float *buf, int64_t n);
/* Rank-ordered concatenation: every member contributes n floats, recv gets size x n. */
mdt_status mdt_allgather_floats(mdt_mesh *m, mdt_group g, const float *send, float *recv,
                                int64_t n);
/* Member i contributes counts[i] floats; recv gets them concatenated in member order (displs =
 * running sums of counts, computed here). */
mdt_status mdt_allgatherv_floats(mdt_mesh *m, mdt_group g, const float *send, float *recv,
                                 const int64_t *counts);
/* Every member's int64 value, in member order (lengths exchanged on every call, never cached:
 * ranks must never disagree on whether to enter a collective). */
mdt_status mdt_allgather_i64(mdt_mesh *m, mdt_group g, int64_t v, int64_t *all);
/* All-to-all with per-member counts and displacements (in floats). */
mdt_status mdt_alltoallv_floats(mdt_mesh *m, mdt_group g, const float *send, const int64_t *scounts,
                                const int64_t *sdispls, float *recv, const int64_t *rcounts,
                                const int64_t *rdispls);
/* Ring step over group g: send n floats to member (me + 1) and receive n floats from member
 * (me - 1), non-blocking; finish with mdt_ring_wait. Device buffers: the send block is staged
 * (or handed to NCCL) at start, the received one lands in `recv` at wait. */
typedef struct mdt_ring_req {
    MPI_Request req[2];
    float *recv;      /* where the block must end up */
    float *host_recv; /* staging buffer it arrives in (NULL: straight into recv) */
    int64_t n;
    int on_device_comm; /* moved by the device communicator of `group` */
    int group;
} mdt_ring_req;
mdt_status mdt_ring_start(mdt_mesh *m, mdt_group g, const float *send, float *recv, int64_t n,
                          mdt_ring_req *rq);
mdt_status mdt_ring_wait(mdt_mesh *m, mdt_ring_req *rq);
/* Moves a started ring step along (one MPI_Testall): transports that move data only inside MPI
 * calls (Open MPI's TCP, MPICH's shared memory) otherwise leave the block where it is until
 * mdt_ring_wait, so compute between start and wait hides none of the transfer. Call it between
 * pieces of that compute. 1: the step is complete on this rank (or moves on the device
 * communicator, which progresses itself); 0: still under way, or a failure, which
 * mdt_ring_wait then reports. mdt_ring_wait is still required. */
int mdt_ring_progress(mdt_mesh *m, mdt_ring_req *rq);

/* ---- the step watchdog (watchdog.c) ---- */
/* Arms (seconds > 0) or disarms (0) the stall bound for every later collective wait. */
void mdt_mesh_set_deadline(mdt_mesh *m, double seconds);
/* Waits for n requests of a collective ("tp all-reduce") over `comm`: spins briefly, then sleeps
 * with backoff (a waiting rank does not burn a core), answering other ranks' watchdog questions.
 * Past the deadline: asks every rank whether it is alive and waiting; the lowest waiting rank
 * returns MDT_E_MPI naming the ranks that did not arrive, with m->peers_stuck set (the caller
 * ends the job); other waiting ranks keep waiting for that end, then report as well. */
mdt_status mdt_mesh_wait(mdt_mesh *m, MPI_Comm comm, int n, MPI_Request *rq, const char *what);
/* mdt_mesh_wait with the seconds it blocked added to m->wait_s[bucket] (a collective kind or
 * MDT_WAIT_WORLD). */
mdt_status mdt_mesh_wait_in(mdt_mesh *m, int bucket, MPI_Comm comm, int n, MPI_Request *rq,
                            const char *what);
/* Barrier over the whole mesh, watched. */
mdt_status mdt_mesh_barrier(mdt_mesh *m, const char *what);
/* *v <- the minimum of every rank's *v (world), watched. */
mdt_status mdt_mesh_min_i64(mdt_mesh *m, int64_t *v, const char *what);
/* Answers pending watchdog questions (for wait loops outside this file). */
void mdt_mesh_watch_serve(mdt_mesh *m);
/* A rank that failed, on its way into the failure agreement: sends world rank 0 a note (its
 * rank, status and message, tagged with the agreement it precedes) on the `watch` communicator.
 * Rank 0 keeps the note (mdt_mesh_poll_notes); when it then waits in a collective whose
 * communicator has the failed rank as a member and that collective has not completed
 * NOTE_GRACE_S (2 s) after the note was seen — the failed rank has left every collective, so it
 * never will — the wait ends with the failed rank's message ("rank K: ...") and m->peers_stuck
 * set, instead of waiting for the step watchdog: the job ends with the real error at once, and
 * a server's client gets it as its reply. The agreement the note preceded clears it. */
void mdt_mesh_note_failure(mdt_mesh *m, mdt_status local);
/* Rank 0: receives pending failure notes, keeps the first one for the coming agreement. */
void mdt_mesh_poll_notes(mdt_mesh *m);
/* Stop requests: mdt_mesh_request_stop (async-signal-safe, any thread; a server's SIGTERM
 * handler calls it) marks this process as asked to stop. While a mesh is interruptible
 * (mdt_mesh_set_interruptible, around a server's forward) every later collective wait and
 * agreement of it that sees the request ends with MDT_E_STOPPED naming the signal, after sending
 * rank 0 the failure note, with m->peers_stuck set (ranks may leave different collectives: the
 * caller ends the job). A mesh that is not interruptible ignores the request: an idle server
 * stops at its own pace, cleanly. */
void mdt_mesh_request_stop(void);
int mdt_mesh_stop_requested(void);
void mdt_mesh_set_interruptible(mdt_mesh *m, int on);
/* MDT_E_STOPPED with peers_stuck set, when `m` is interruptible and a stop was asked; else
 * MDT_OK. `in_agreement`: called from inside an agreement (its count already taken). */
mdt_status mdt_mesh_check_stop(mdt_mesh *m, const char *what, int in_agreement);
/* Called by a waiting loop that passed the deadline: see mdt_mesh_wait. */
mdt_status mdt_mesh_stalled(mdt_mesh *m, const char *what, double waited);

#endif /* MDT_MESH_H */
