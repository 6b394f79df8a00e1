/*
 * watchdog.c — see mesh.h: collective waits that neither burn a core nor wait forever.
 *
 * Every collective of the mesh is non-blocking underneath; mdt_mesh_wait tests its requests,
 * first in a tight loop (1 ms: a healthy collective finishes here, with no added latency), then
 * with sleeps growing to 1 ms (a rank waiting for a slow or stopped peer uses ~0% CPU). While
 * waiting it answers the watchdog's questions on the `watch` communicator (a duplicate of the
 * world, tags of its own), so a stalled rank can find out who is alive and waiting.
 *
 * Past the deadline a rank sends every other rank a question and listens for a grace period
 * (1–5 s). Ranks that do not answer did not reach a collective: stopped, hung, dead or still
 * computing past the bound. The lowest rank that is itself waiting reports them (one line) and
 * its caller ends the job; the others wait for that end a little longer before reporting too.
 */
#define _POSIX_C_SOURCE 200809L
#include "mesh.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

enum {
    TAG_ASK = 9101,
    TAG_ANSWER = 9102,
    TAG_FAILED = 9103,
    NOTE_HEAD = 12, /* int64 agreement, int32 status, then the message */
    NOTE_GRACE_S = 2,
    SPIN_NS = 1000000,
    NAP_MAX_NS = 1000000,
    /* a waiting rank naps at most this long between tests: transports that move data only inside
     * MPI calls (Open MPI's TCP, MPICH's shared memory) stall while it sleeps; at 1 ms a ring
     * transfer across a 1 Gbit/s link ran at half the link's rate (docs/perf.md) */
    WAIT_NAP_MAX_NS = 50000
};

void mdt_mesh_set_deadline(mdt_mesh *m, double seconds) { mdt_mesh_watch(m, seconds, NULL); }

static volatile sig_atomic_t g_stop_requested;

void mdt_mesh_request_stop(void) { g_stop_requested = 1; }
int mdt_mesh_stop_requested(void) { return g_stop_requested != 0; }

void mdt_mesh_set_interruptible(mdt_mesh *m, int on) {
    if (m)
        m->interruptible = on;
}

mdt_status mdt_mesh_check_stop(mdt_mesh *m, const char *what, int in_agreement) {
    if (!m || !m->interruptible || !g_stop_requested)
        return MDT_OK;
    m->waiting = 0;
    const mdt_status st = MDT_FAIL(MDT_E_STOPPED,
                                   "stopped by a signal (SIGTERM or SIGINT) while waiting in the "
                                   "%s of a forward: the server is ending",
                                   what);
    /* the note names the agreement this rank would have gone to next, which is what rank 0
     * waits for (the job ends before any agreement is held: peers_stuck skips them all) */
    m->agreements += !in_agreement;
    mdt_mesh_note_failure(m, st); /* rank 0 ends its own wait with this line */
    m->agreements -= !in_agreement;
    m->peers_stuck = 1;
    return st;
}

void mdt_mesh_watch(mdt_mesh *m, double seconds, const char *option) {
    if (!m)
        return;
    m->deadline_s = seconds > 0 ? seconds : 0;
    m->deadline_opt = option ? option : "--step-timeout";
}

static void nap(long ns) {
    const struct timespec t = {0, ns};
    nanosleep(&t, NULL);
}

void mdt_mesh_watch_serve(mdt_mesh *m) {
    if (!m || m->watch == MPI_COMM_NULL)
        return;
    for (;;) {
        int flag = 0, q;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ASK, m->watch, &flag, &st) != MPI_SUCCESS || !flag)
            return;
        MPI_Recv(&q, 1, MPI_INT, st.MPI_SOURCE, TAG_ASK, m->watch, MPI_STATUS_IGNORE);
        const int a[2] = {m->world_rank, m->waiting}; /* tiny: sent eagerly, never blocks */
        MPI_Send(a, 2, MPI_INT, st.MPI_SOURCE, TAG_ANSWER, m->watch);
    }
}

void mdt_mesh_note_failure(mdt_mesh *m, mdt_status local) {
    if (!m || m->world_rank == 0 || m->world_size == 1 || m->watch == MPI_COMM_NULL)
        return;
    const int32_t code = (int32_t)local;
    memcpy(m->note_out, &m->agreements, 8);
    memcpy(m->note_out + 8, &code, 4);
    mdt_fit_text(mdt_last_error(), m->note_out + NOTE_HEAD, sizeof m->note_out - NOTE_HEAD);
    const int n = NOTE_HEAD + (int)strlen(m->note_out + NOTE_HEAD) + 1;
    MPI_Request r; /* small: sent eagerly; rank 0 may be gone, so it is not waited for */
    if (MPI_Isend(m->note_out, n, MPI_BYTE, 0, TAG_FAILED, m->watch, &r) == MPI_SUCCESS)
        MPI_Request_free(&r);
}

void mdt_mesh_poll_notes(mdt_mesh *m) {
    if (!m || m->world_rank != 0 || m->watch == MPI_COMM_NULL)
        return;
    if (m->note_rank >= 0 && m->note_epoch <= m->agreements)
        m->note_rank = -1; /* the agreement it preceded was held: its failure was agreed on */
    for (;;) {
        int flag = 0, n = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_FAILED, m->watch, &flag, &st) != MPI_SUCCESS || !flag)
            return;
        char buf[sizeof m->note_msg + NOTE_HEAD + 1];
        MPI_Get_count(&st, MPI_BYTE, &n);
        if (n < 0 || n > (int)sizeof buf - 1)
            n = (int)sizeof buf - 1;
        MPI_Recv(buf, n, MPI_BYTE, st.MPI_SOURCE, TAG_FAILED, m->watch, MPI_STATUS_IGNORE);
        buf[n] = '\0';
        int64_t epoch = 0;
        int32_t code = 0;
        if (n < NOTE_HEAD)
            continue;
        memcpy(&epoch, buf, 8);
        memcpy(&code, buf + 8, 4);
        if (epoch != m->agreements + 1 || code == MDT_OK || m->note_rank >= 0)
            continue; /* stale, or a second failed rank (the first one is reported) */
        m->note_rank = st.MPI_SOURCE, m->note_code = code, m->note_epoch = epoch;
        const size_t len = strnlen(buf + NOTE_HEAD, sizeof m->note_msg - 1);
        memcpy(m->note_msg, buf + NOTE_HEAD, len);
        m->note_msg[len] = '\0';
    }
}

/* Whether world rank `k` belongs to `comm`. */
static int is_member(const mdt_mesh *m, MPI_Comm comm, int k) {
    MPI_Group w, g;
    int out = MPI_UNDEFINED;
    if (comm == MPI_COMM_NULL || MPI_Comm_group(m->world, &w) != MPI_SUCCESS)
        return 0;
    if (MPI_Comm_group(comm, &g) == MPI_SUCCESS) {
        MPI_Group_translate_ranks(w, 1, &k, g, &out);
        MPI_Group_free(&g);
    }
    MPI_Group_free(&w);
    return out != MPI_UNDEFINED;
}

/* The failure of the noted rank, as the agreement would word it; the job is being ended. */
static mdt_status noted_failure(mdt_mesh *m) {
    m->peers_stuck = 1;
    if (strncmp(m->note_msg, "rank ", 5) == 0) /* already agreed on at an inner phase boundary */
        return MDT_FAIL((mdt_status)m->note_code, "%s", m->note_msg);
    return MDT_FAIL((mdt_status)m->note_code, "rank %d: %s", m->note_rank, m->note_msg);
}

/* Asks every rank, listens for the grace period; the lowest rank that is itself waiting reports. */
mdt_status mdt_mesh_stalled(mdt_mesh *m, const char *what, double waited) {
    const int P = m->world_size, me = m->world_rank;
    int answered[4096] = {0}, waiting[4096] = {0};
    if (P > 4096)
        return MDT_FAIL(MDT_E_MPI, "%s: no peer arrived within %.0f s", what, waited);
    const int q = 1;
    for (int p = 0; p < P; p++) {
        if (p == me)
            continue;
        MPI_Request r;
        if (MPI_Isend(&q, 1, MPI_INT, p, TAG_ASK, m->watch, &r) == MPI_SUCCESS)
            MPI_Request_free(&r); /* a stopped peer never receives it: not waited for */
    }
    answered[me] = 1, waiting[me] = 1;
    double grace = m->deadline_s * 0.1; /* 1-5 s to hear from every live rank */
    grace = grace < 1.0 ? 1.0 : (grace > 5.0 ? 5.0 : grace);
    const double t0 = mdt_now();
    int n_answered = 1;
    while (mdt_now() - t0 < grace && n_answered < P) {
        mdt_mesh_watch_serve(m);
        int flag = 0, a[2];
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ANSWER, m->watch, &flag, &st) == MPI_SUCCESS && flag) {
            MPI_Recv(a, 2, MPI_INT, st.MPI_SOURCE, TAG_ANSWER, m->watch, MPI_STATUS_IGNORE);
            if (a[0] >= 0 && a[0] < P && !answered[a[0]])
                answered[a[0]] = 1, waiting[a[0]] = a[1], n_answered++;
            continue;
        }
        nap(200000);
    }
    int lowest_waiting = me;
    for (int p = 0; p < me; p++)
        if (answered[p] && waiting[p]) {
            lowest_waiting = p;
            break;
        }
    if (lowest_waiting != me) { /* that rank reports and ends the job; keep answering meanwhile */
        const double t1 = mdt_now();
        while (mdt_now() - t1 < 3.0 * grace) {
            mdt_mesh_watch_serve(m);
            nap(NAP_MAX_NS);
        }
    }
    char list[256] = "";
    int missing = 0;
    for (int p = 0; p < P; p++)
        if (!answered[p]) {
            char one[16];
            snprintf(one, sizeof one, "%s%d", missing ? ", " : "", p);
            if (strlen(list) + strlen(one) + 5 < sizeof list)
                strcat(list, one);
            else if (!strstr(list, "..."))
                strcat(list, ", ...");
            missing++;
        }
    m->peers_stuck = 1;
    if (!missing) /* everyone alive and waiting: they wait in different collectives */
        return MDT_FAIL(MDT_E_MPI,
                        "step watchdog: %s did not complete within %.0f s although every rank is "
                        "alive (ranks wait in different collectives)",
                        what, waited);
    return MDT_FAIL(MDT_E_MPI,
                    "step watchdog: rank%s %s did not reach the %s within %.0f s (stopped, hung, "
                    "dead or still computing); %s sets the bound",
                    missing > 1 ? "s" : "", list, what, waited,
                    m->deadline_opt ? m->deadline_opt : "--step-timeout");
}

mdt_status mdt_mesh_wait(mdt_mesh *m, MPI_Comm comm, int n, MPI_Request *rq, const char *what) {
    const double t0 = mdt_now();
    double noted = -1; /* when a failure note of a member of `comm` was seen (0: not a member) */
    long ns = 20000;
    int done = 0;
    MPI_Status sts[4];
    if (n > 4)
        return MDT_FAIL(MDT_E_INVALID, "%s: %d requests (at most 4)", what, n);
    m->waiting = 1;
    for (;;) {
        if (MPI_Testall(n, rq, &done, sts) != MPI_SUCCESS) {
            m->waiting = 0;
            return MDT_FAIL(MDT_E_MPI, "%s failed", what);
        }
        if (done)
            break;
        const double waited = mdt_now() - t0;
        if (waited * 1e9 < SPIN_NS)
            continue;
        mdt_mesh_watch_serve(m);
        const mdt_status stop = mdt_mesh_check_stop(m, what, 0);
        if (stop != MDT_OK)
            return stop; /* the requests are abandoned: the job is being ended */
        /* a member of this collective failed and went to the agreement: once any message of
         * its that was already on the way has had NOTE_GRACE_S to land, it never comes */
        mdt_mesh_poll_notes(m);
        if (m->note_rank >= 0 && noted < 0)
            noted = is_member(m, comm, m->note_rank) ? mdt_now() : 0.0;
        if (noted > 0 && mdt_now() - noted > NOTE_GRACE_S) {
            m->waiting = 0;
            return noted_failure(m); /* the requests are abandoned: the job is being ended */
        }
        if (m->deadline_s > 0 && waited > m->deadline_s) {
            const mdt_status st = mdt_mesh_stalled(m, what, waited);
            m->waiting = 0;
            return st; /* the requests are abandoned: the job is being ended */
        }
        nap(ns);
        ns = ns * 2 > WAIT_NAP_MAX_NS ? WAIT_NAP_MAX_NS : ns * 2;
    }
    m->waiting = 0;
    return MDT_OK;
}

mdt_status mdt_mesh_wait_in(mdt_mesh *m, int bucket, MPI_Comm comm, int n, MPI_Request *rq,
                            const char *what) {
    const double t0 = mdt_now();
    const mdt_status st = mdt_mesh_wait(m, comm, n, rq, what);
    m->wait_s[bucket] += mdt_now() - t0;
    return st;
}

mdt_status mdt_mesh_barrier(mdt_mesh *m, const char *what) {
    if (!m || m->world_size == 1)
        return MDT_OK;
    MPI_Request r;
    m->world_collectives++;
    if (MPI_Ibarrier(m->world, &r) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "%s: MPI_Ibarrier failed", what);
    return mdt_mesh_wait_in(m, MDT_WAIT_WORLD, m->world, 1, &r, what);
}

mdt_status mdt_mesh_min_i64(mdt_mesh *m, int64_t *v, const char *what) {
    if (!m || m->world_size == 1)
        return MDT_OK;
    long long in = (long long)*v, out = 0;
    MPI_Request r;
    m->world_collectives++;
    if (MPI_Iallreduce(&in, &out, 1, MPI_LONG_LONG, MPI_MIN, m->world, &r) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "%s: MPI_Iallreduce failed", what);
    MDT_TRY(mdt_mesh_wait_in(m, MDT_WAIT_WORLD, m->world, 1, &r, what));
    *v = (int64_t)out;
    return MDT_OK;
}
