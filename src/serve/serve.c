/*
 * serve.c — the resident server (meshdit.h: mdt_serve; the protocol is docs/serve.md). World
 * rank 0's connections are listener.c's (a thread of their own, speaking ZMTP: zmtp.h); a request
 * that passes validation (proto.c) is broadcast over a duplicate of the mesh's world communicator
 * — a header (operation, blob size), then the blob — and every rank parses and runs it; rank 0
 * replies. A request that fails validation is answered by rank 0 alone: the other ranks never see
 * it.
 *
 * Stopping without a hang: SIGTERM/SIGINT handlers (the caller's) call mdt_serve_stop, which
 * sets a flag. Rank 0 checks it between waits for the next request (100 ms); the other ranks wait
 * for the next header in MPI_Ibcast polled with MPI_Test, and one that sees the flag sends rank 0 a
 * note (one int, tag k_tag_stop); rank 0, on its flag or a note, broadcasts the STOP header and
 * every rank leaves; rank 0 answers the requests still queued (and those arriving until its
 * listener closes) with why, as after a close. At the end every rank says how many notes it sent
 * and rank 0 receives the ones still in flight, so nothing is pending at MPI_Finalize.
 *
 * Not here: option parsing and signal handlers (the caller), the messages (proto.c), the
 * sessions (session.c), the sockets (listener.c, endpoint.c).
 */
#define _POSIX_C_SOURCE 200809L
#include "serve/serve.h"

#include "models/cache.h"

#include "comm/mesh.h"
#include "models/model.h"

#include "io/safetensors.h"
#include "parallel/plan.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t g_stop;

void mdt_serve_stop(void) {
    g_stop = 1;
    mdt_mesh_request_stop(); /* a forward under way ends at its next wait (interruptible) */
}

enum { k_tag_stop = 7717, k_tag_spec = 7718, k_poll_ms = 100 };
enum { ENDED_STOP = 1, ENDED_CLOSE }; /* how the loop ended (serve_ctx.ended_by) */
#define MDT_SERVE_LORA_KEY (MDT_SERVE_LORA_MAX * (MDT_SERVE_ADAPTER_NAME_MAX + 27) + 2)
/* The header rank 0 broadcasts for each turn of the loop: the operation, the blob's size, rank
 * 0's clock (ms), and two words a turn may carry (a new session's token). */
enum { H_OP, H_BYTES, H_NOW_MS, H_WORD0, H_WORD1, MDT_SERVE_HDR };
#define CHUNK_BYTES ((int64_t)1 << 28) /* a blob is broadcast in pieces of this many bytes */

mdt_serve_params mdt_serve_params_default(void) {
    return (mdt_serve_params){.max_sessions = 4,
                              .max_session_bytes = (int64_t)1 << 30,
                              .session_idle = 300.0,
                              .max_request_bytes = (int64_t)2 << 30,
                              .max_queue_bytes = 0,
                              .handshake_timeout = 5.0,
                              .message_timeout = 30.0,
                              .min_rate = (int64_t)64 << 10};
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the server's state on one rank ---- */

typedef struct serve_ctx {
    mdt_model *m;
    mdt_mesh *mesh; /* NULL: one rank, no MPI */
    const mdt_serve_params *p;
    MPI_Comm comm; /* the world, duplicated: the server's own traffic */
    int rank, world;
    mdt_serve_listener *l; /* rank 0 */
    int own_listener;      /* made here (p->listener was NULL): freed here */
    mdt_serve_sessions ss;
    mdt_serve_caches cs;     /* step caches of generations (caches.c) */
    mdt_serve_budget budget; /* this rank's memory per forward */
    int stop;                /* rank 0: a stop was asked here or by a note */
    int ended_by;            /* the loop ended on a stop (ENDED_STOP) or a close (0: neither) */
    int note_sent;           /* ranks > 0: a stop note is in flight */
    int note_val;            /* its payload */
    MPI_Request note_rq;
    int *notes_recv;    /* rank 0: notes received per rank */
    double last_header; /* rank 0: when it last broadcast a header (heartbeats follow it) */
    /* the adapters fused at the start (--lora): a forward without "lora" runs with them */
    int n_start;
    char start_names[MDT_SERVE_LORA_MAX][MDT_SERVE_ADAPTER_NAME_MAX + 1];
    double start_w[MDT_SERVE_LORA_MAX];
    /* --cfg 2: group 1 computes the other branch of a guided step while group 0 computes the
     * request (docs/serve.md, "Two branches at once"); its inputs are kept on every rank (a later
     * request that equals them, byte for byte, is answered with its outputs), its outputs on
     * rank 0 */
    int C, grp, spec_leader; /* cfg degree, this rank's group, this rank leads group 1 */
    int leader1;             /* group 1's leader's world rank */
    mdt_tensor_set *spec_in, *spec_out;
    double spec_s;                      /* the speculative forward's seconds */
    char spec_lora[MDT_SERVE_LORA_KEY]; /* the adapters it ran with (lora_key) */
    /* with a step cache: the generation and branch it ran as ("": none; group 1's ranks hold
     * that branch's state tentatively until the request it answers comes), and (rank 0) its
     * decision */
    char spec_gen[MDT_SERVE_NAME_MAX + 1], spec_ctx[MDT_SERVE_CACHE_NAME_MAX + 1];
    int64_t spec_serial; /* that generation's serial: not a later one of the same name */
    mdt_cache_step spec_step;
    int64_t cfg_hits, cfg_speculated;
} serve_ctx;

/* Ranks > 0, waiting for a header: tell rank 0 once that a stop was asked here. */
static mdt_status note_stop(serve_ctx *c) {
    if (!g_stop || c->note_sent)
        return MDT_OK;
    c->note_val = 1;
    if (MPI_Isend(&c->note_val, 1, MPI_INT, 0, k_tag_stop, c->comm, &c->note_rq) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "serve: sending the stop note to rank 0 failed");
    c->note_sent = 1;
    return MDT_OK;
}

/* Rank 0: stop notes that arrived. */
static mdt_status take_notes(serve_ctx *c) {
    int flag = 0;
    MPI_Status s;
    while (c->world > 1) {
        if (MPI_Iprobe(MPI_ANY_SOURCE, k_tag_stop, c->comm, &flag, &s) != MPI_SUCCESS)
            return MDT_FAIL(MDT_E_MPI, "serve: probing for stop notes failed");
        if (!flag)
            return MDT_OK;
        int v;
        if (MPI_Recv(&v, 1, MPI_INT, s.MPI_SOURCE, k_tag_stop, c->comm, MPI_STATUS_IGNORE) !=
            MPI_SUCCESS)
            return MDT_FAIL(MDT_E_MPI, "serve: receiving a stop note failed");
        c->notes_recv[s.MPI_SOURCE]++;
        c->stop = 1;
    }
    return MDT_OK;
}

/* The bound every wait of the loop is watched with: the forward's (mdt_model_forward), i.e.
 * --step-timeout, else 10 x the longest forward so far, at least 60 s. */
static double loop_bound(const serve_ctx *c) {
    const mdt_model *m = c->m;
    if (m->step_timeout > 0)
        return m->step_timeout;
    return 10.0 * m->longest_s > 60.0 ? 10.0 * m->longest_s : 60.0;
}

/* Rank 0 broadcasts a header at least this often while idle: the ranks waiting for it then
 * know within heartbeat + bound that rank 0 is gone, and the heartbeat's barrier shows rank 0
 * within the bound that each of them is there. */
static double heartbeat_s(const serve_ctx *c) {
    const double b = loop_bound(c) / 4;
    return b < 1.0 ? b : 1.0;
}

/* The header from rank 0. Non-blocking on every rank (a non-blocking collective matches only
 * non-blocking ones) and watched: rank 0 waits at most the bound; the other ranks poll it so that
 * a stop signal reaches them, answer the watchdog's questions meanwhile, and take a header that
 * does not come within heartbeat + bound for rank 0 having stopped (mdt_mesh_stalled names it). */
static mdt_status bcast_header(serve_ctx *c, int64_t hdr[MDT_SERVE_HDR]) {
    if (c->world == 1 || !c->mesh)
        return MDT_OK;
    MPI_Request rq;
    if (MPI_Ibcast(hdr, MDT_SERVE_HDR, MPI_INT64_T, 0, c->comm, &rq) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "serve: broadcasting a request header failed");
    if (c->rank == 0)
        return mdt_mesh_wait(c->mesh, c->comm, 1, &rq, "request header");
    const double t0 = now_s(), limit = heartbeat_s(c) + loop_bound(c);
    mdt_status st = MDT_OK;
    c->mesh->waiting = 1;
    for (;;) {
        int done = 0;
        if (MPI_Test(&rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
            st = MDT_FAIL(MDT_E_MPI, "serve: waiting for a request header failed");
            break;
        }
        if (done || (st = note_stop(c)) != MDT_OK)
            break;
        mdt_mesh_watch_serve(c->mesh);
        if (now_s() - t0 > limit) { /* the request is abandoned: the job is being ended */
            st = mdt_mesh_stalled(c->mesh, "request header", now_s() - t0);
            break;
        }
        const struct timespec ts = {0, 2000000}; /* 2 ms: an idle rank uses no CPU to speak of */
        nanosleep(&ts, NULL);
    }
    c->mesh->waiting = 0;
    return st;
}

static mdt_status bcast_blob(serve_ctx *c, unsigned char *blob, int64_t n) {
    for (int64_t off = 0; c->world > 1 && off < n; off += CHUNK_BYTES) {
        const int len = (int)(n - off < CHUNK_BYTES ? n - off : CHUNK_BYTES);
        MPI_Request rq;
        if (MPI_Ibcast(blob + off, len, MPI_BYTE, 0, c->comm, &rq) != MPI_SUCCESS)
            return MDT_FAIL(MDT_E_MPI, "serve: broadcasting a request failed");
        MDT_TRY(mdt_mesh_wait(c->mesh, c->comm, 1, &rq, "request broadcast"));
    }
    return MDT_OK;
}

/* After the loop, on every rank: rank 0 receives every stop note still in flight. */
static mdt_status drain_notes(serve_ctx *c) {
    if (c->world == 1)
        return MDT_OK;
    int sent = c->note_sent;
    int *all = c->rank == 0 ? mdt_calloc(sizeof(int) * (size_t)c->world) : NULL;
    if (c->rank == 0 && !all)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    MPI_Request rq;
    mdt_status st = MDT_OK;
    if (MPI_Igather(&sent, 1, MPI_INT, all, 1, MPI_INT, 0, c->comm, &rq) != MPI_SUCCESS)
        st = MDT_FAIL(MDT_E_MPI, "serve: the closing gather failed");
    else
        st = mdt_mesh_wait(c->mesh, c->comm, 1, &rq, "closing gather");
    for (int r = 0; st == MDT_OK && c->rank == 0 && r < c->world; r++)
        for (; c->notes_recv[r] < all[r]; c->notes_recv[r]++) {
            int v;
            MPI_Recv(&v, 1, MPI_INT, r, k_tag_stop, c->comm, MPI_STATUS_IGNORE);
        }
    if (c->note_sent && st == MDT_OK)
        MPI_Wait(&c->note_rq, MPI_STATUS_IGNORE);
    mdt_free(all);
    return st;
}

/* ---- LoRA adapters: each forward runs with the set it names ---- */

static void note_startup_adapters(serve_ctx *c) {
    for (int i = 0; i < mdt_model_lora_count(c->m) && c->n_start < MDT_SERVE_LORA_MAX; i++) {
        mdt_lora_info li;
        if (mdt_model_lora_info(c->m, i, &li) == MDT_OK && li.active) {
            snprintf(c->start_names[c->n_start], sizeof c->start_names[0], "%s", li.name);
            c->start_w[c->n_start++] = li.weight;
        }
    }
}

static int is_startup(const serve_ctx *c, const char *name) {
    for (int i = 0; i < c->n_start; i++)
        if (strcmp(c->start_names[i], name) == 0)
            return 1;
    return 0;
}

/* Fuses the adapters this forward runs with (its "lora", else those of the server's start)
 * unless they are fused now, at the same weights; *fuse_s: the seconds it took (-1: nothing to
 * do). Every rank holds the same adapters and the same request, so every rank decides alike;
 * mdt_model_set_adapters is collective and agreed. So a client never runs with another's set. */
static mdt_status use_adapters(serve_ctx *c, const mdt_serve_request *r, double *fuse_s) {
    const char *names[MDT_SERVE_LORA_MAX];
    double w[MDT_SERVE_LORA_MAX];
    const int n = r->has_lora ? r->n_lora : c->n_start;
    for (int i = 0; i < n; i++) {
        names[i] = r->has_lora ? r->lora_names[i] : c->start_names[i];
        w[i] = r->has_lora ? r->lora_weights[i] : c->start_w[i];
    }
    int fused = 0, same = 1;
    for (int i = 0; i < mdt_model_lora_count(c->m); i++) {
        mdt_lora_info li;
        if (mdt_model_lora_info(c->m, i, &li) != MDT_OK || !li.active)
            continue;
        fused++;
        int found = 0;
        for (int j = 0; j < n && !found; j++)
            found = strcmp(names[j], li.name) == 0 && w[j] == li.weight;
        same = same && found;
    }
    *fuse_s = -1;
    if (same && fused == n)
        return MDT_OK;
    const double t0 = now_s();
    const mdt_status st = mdt_model_set_adapters(c->m, n, names, w);
    *fuse_s = now_s() - t0;
    return st;
}

static void spec_drop(serve_ctx *c);

static mdt_status op_lora_load(serve_ctx *c, const mdt_serve_request *r, unsigned char **reply,
                               size_t *rn) {
    char shown[MDT_SERVE_ADAPTER_NAME_MAX + 32];
    mdt_status st;
    spec_drop(c); /* an adapter of that name may be another now: no answer computed before */
    if (mdt_model_lora_count(c->m) >= MDT_SERVE_LORA_MAX) /* the same count on every rank */
        st = MDT_FAIL(MDT_E_INVALID,
                      "lora_load: %d adapters are loaded, the server's limit: lora_unload one "
                      "first",
                      MDT_SERVE_LORA_MAX);
    else {
        snprintf(shown, sizeof shown, "adapter '%s'", r->adapter);
        st = mdt_model_lora_load_mem(c->m, r->adapter, r->blob, (size_t)r->bytes, shown);
    }
    if (c->rank != 0)
        return MDT_OK;
    if (st != MDT_OK)
        return mdt_serve_reply_error("lora_load", r->id, mdt_last_error(), st, reply, rn);
    mdt_lora_info li;
    mdt_model_lora_info(c->m, mdt_model_lora_count(c->m) - 1, &li);
    char targets[24], rmin[24], rmax[24], bytes[24];
    snprintf(targets, sizeof targets, "%d", li.targets);
    snprintf(rmin, sizeof rmin, "%lld", (long long)li.rank_min);
    snprintf(rmax, sizeof rmax, "%lld", (long long)li.rank_max);
    snprintf(bytes, sizeof bytes, "%lld", (long long)li.bytes);
    const char *meta[] = {
        "op",    "lora_load", "id", r->id,      "adapter_name", r->adapter,     "linear_weights",
        targets, "rank_min",  rmin, "rank_max", rmax,           "factor_bytes", bytes,
        NULL};
    return mdt_serve_reply_ok(meta, NULL, reply, rn);
}

static mdt_status op_lora_unload(serve_ctx *c, const mdt_serve_request *r, unsigned char **reply,
                                 size_t *rn) {
    char shown[MDT_ESC_NAME];
    spec_drop(c); /* the answer computed with it must not outlive it */
    const mdt_status st =
        is_startup(c, r->adapter)
            ? MDT_FAIL(MDT_E_INVALID,
                       "lora_unload: adapter '%s' was fused at the server's start (--lora) and "
                       "stays loaded",
                       mdt_escape(r->adapter, shown, sizeof shown))
            : mdt_model_lora_unload(c->m, r->adapter);
    if (c->rank != 0)
        return MDT_OK;
    if (st != MDT_OK)
        return mdt_serve_reply_error("lora_unload", r->id, mdt_last_error(), st, reply, rn);
    const char *meta[] = {"op", "lora_unload", "id", r->id, "adapter_name", r->adapter, NULL};
    return mdt_serve_reply_ok(meta, NULL, reply, rn);
}

/* info's "adapters": the start-up adapters as JSON text (cJSON_free it), NULL out of memory.
 * A client's adapters are not listed: their names are that client's to give. */
static char *adapters_json(const serve_ctx *c) {
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; arr && i < mdt_model_lora_count(c->m); i++) {
        mdt_lora_info li;
        if (mdt_model_lora_info(c->m, i, &li) != MDT_OK || !is_startup(c, li.name))
            continue;
        cJSON *a = cJSON_CreateObject();
        if (!a) {
            cJSON_Delete(a);
            continue;
        }
        cJSON_AddItemToArray(arr, a);
        cJSON_AddStringToObject(a, "name", li.name);
        cJSON_AddBoolToObject(a, "fused", li.active);
        cJSON_AddNumberToObject(a, "weight", li.weight);
        cJSON_AddNumberToObject(a, "linear_weights", li.targets);
        cJSON_AddNumberToObject(a, "rank_min", (double)li.rank_min);
        cJSON_AddNumberToObject(a, "rank_max", (double)li.rank_max);
    }
    char *txt = arr ? cJSON_PrintUnformatted(arr) : NULL;
    cJSON_Delete(arr);
    return txt;
}

/* ---- the operations, run on every rank ---- */

static mdt_status op_info(serve_ctx *c, const mdt_serve_request *r, unsigned char **reply,
                          size_t *rn) {
    int64_t wb = mdt_model_weight_bytes(c->m);
    int64_t *all = c->rank == 0 ? mdt_calloc(sizeof(int64_t) * (size_t)c->world) : NULL;
    mdt_status st = (c->rank == 0 && !all) ? MDT_FAIL(MDT_E_NOMEM, "out of memory") : MDT_OK;
    MPI_Request rq;
    if (c->world > 1 &&
        MPI_Igather(&wb, 1, MPI_INT64_T, all, 1, MPI_INT64_T, 0, c->comm, &rq) != MPI_SUCCESS)
        st = MDT_FAIL(MDT_E_MPI, "serve: gathering the weight bytes failed");
    else if (c->world > 1) {
        const mdt_status w = mdt_mesh_wait(c->mesh, c->comm, 1, &rq, "weight-bytes gather");
        st = st != MDT_OK ? st : w;
    } else if (all) {
        all[0] = wb;
    }
    if (c->rank != 0 || st != MDT_OK) {
        mdt_free(all);
        return st;
    }
    char *cfg = cJSON_PrintUnformatted(c->m->config), *adapters = adapters_json(c);
    const cJSON *cls = cJSON_GetObjectItemCaseSensitive(c->m->config, "_class_name");
    char *wlist = mdt_alloc((size_t)c->world * 24 + 1);
    char tp[16], ring[16], uly[16], world[16], order[32], ms[32], msb[32], mrb[32], idle[32],
        nad[16], cfgd[8];
    int T, R, U;
    mdt_device_info d;
    mdt_device_info_get(&d);
    mdt_model_layout(c->m, &T, &R, &U);
    snprintf(tp, sizeof tp, "%d", T), snprintf(ring, sizeof ring, "%d", R);
    snprintf(uly, sizeof uly, "%d", U), snprintf(world, sizeof world, "%d", c->world);
    if (c->mesh)
        mdt_mesh_order_str(c->mesh->order, order, sizeof order);
    else
        snprintf(order, sizeof order, "tp,ring,ulysses");
    snprintf(ms, sizeof ms, "%d", c->p->max_sessions);
    snprintf(msb, sizeof msb, "%lld", (long long)c->p->max_session_bytes);
    snprintf(mrb, sizeof mrb, "%lld", (long long)c->p->max_request_bytes);
    snprintf(idle, sizeof idle, "%g", c->p->session_idle);
    snprintf(nad, sizeof nad, "%d", mdt_model_lora_count(c->m));
    snprintf(cfgd, sizeof cfgd, "%d", c->C);
    if (!cfg || !wlist || !all || !adapters)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    else {
        size_t off = 0;
        for (int i = 0; i < c->world; i++)
            off += (size_t)sprintf(wlist + off, "%s%lld", i ? "," : "", (long long)all[i]);
        const char *meta[] = {"op",
                              "info",
                              "id",
                              r->id,
                              "protocol",
                              "1",
                              "family",
                              mdt_model_family(c->m),
                              "class_name",
                              cJSON_IsString(cls) ? cls->valuestring : "",
                              "config",
                              cfg,
                              "world",
                              world,
                              "cfg",
                              cfgd,
                              "tp",
                              tp,
                              "ring",
                              ring,
                              "ulysses",
                              uly,
                              "mesh_order",
                              order,
                              "device",
                              d.backend,
                              "dtype",
                              d.bf16 ? "bf16" : "f32",
                              "weight_bytes",
                              wlist,
                              "max_sessions",
                              ms,
                              "max_session_bytes",
                              msb,
                              "max_request_bytes",
                              mrb,
                              "session_idle",
                              idle,
                              "adapters",
                              adapters,
                              "adapters_loaded",
                              nad,
                              NULL};
        st = mdt_serve_reply_ok(meta, NULL, reply, rn);
    }
    cJSON_free(cfg);
    cJSON_free(adapters);
    mdt_free(wlist);
    mdt_free(all);
    return st;
}

/* ---- --cfg 2: the other branch at once ---- */

/* Every tensor of `a` is in `b` with the same dtype, shape and bytes, and the other way round. */
static int sets_equal(const mdt_tensor_set *a, const mdt_tensor_set *b) {
    if (!a || !b || mdt_tensor_set_count(a) != mdt_tensor_set_count(b))
        return 0;
    for (int i = 0; i < mdt_tensor_set_count(a); i++) {
        const char *name;
        const mdt_tensor *x = mdt_tensor_set_at(a, i, &name), *y = mdt_tensor_set_get(b, name);
        if (!y || x->dtype != y->dtype || x->ndim != y->ndim ||
            memcmp(x->shape, y->shape, sizeof(int64_t) * (size_t)x->ndim) != 0 ||
            memcmp(x->data, y->data, (size_t)mdt_tensor_nbytes(x)) != 0)
            return 0;
    }
    return 1;
}

/* The adapters a forward asks for, as one comparable text ("-": the start-up set). */
static void lora_key(const mdt_serve_request *r, char *out, size_t cap) {
    size_t n = (size_t)snprintf(out, cap, "%s", r->has_lora ? "" : "-");
    for (int i = 0; i < r->n_lora && n < cap; i++)
        n += (size_t)snprintf(out + n, cap - n, "%s=%.17g,", r->lora_names[i], r->lora_weights[i]);
}

/* The speculation ends: answered (`keep`: its cache state stays) or stale (undone). */
static void spec_end(serve_ctx *c, int keep) {
    if (c->spec_gen[0]) {
        mdt_cache *g = mdt_serve_caches_serial_of(&c->cs, c->spec_gen) == c->spec_serial
                           ? mdt_serve_caches_find(&c->cs, c->spec_gen)
                           : NULL; /* dropped since (its free undid the step) */
        if (keep)
            mdt_cache_commit(g);
        else
            mdt_cache_rollback(g);
        c->spec_gen[0] = c->spec_ctx[0] = '\0';
    }
    mdt_tensor_set_free(c->spec_in), mdt_tensor_set_free(c->spec_out);
    c->spec_in = c->spec_out = NULL;
}

static void spec_drop(serve_ctx *c) { spec_end(c, 0); }

/* --cfg 2 with a step cache: a generation's branches live on the groups in turn (the first it
 * names on group 0, the second on group 1, ...), and a cached forward runs on its branch's
 * group, which alone holds that branch's state (every rank numbers the branches alike) */
static int branch_group(const serve_ctx *c, const mdt_cache *cache) {
    return c->C == 2 && cache ? cache->cur % 2 : 0;
}

/* The other branch's inputs: this forward's, with the tensors kept under r->cfg_next in place
 * of (or besides) those of the same name. NULL in *out when there is nothing to compute: no
 * cfg 2, no cfg_next, no such session, or (with a step cache) no branch known for it. */
static mdt_status spec_inputs(serve_ctx *c, const mdt_serve_request *r, const mdt_cache *cache,
                              mdt_tensor_set **out) {
    *out = NULL;
    const mdt_tensor_set *kept = mdt_serve_sessions_set_of(&c->ss, r->cfg_next);
    if (c->C != 2 || !r->cfg_next[0] || !kept ||
        (cache && !mdt_serve_sessions_context_of(&c->ss, r->cfg_next)[0]))
        return MDT_OK;
    mdt_tensor_set *in = NULL;
    MDT_TRY(mdt_tensor_set_create(&in));
    mdt_status st = MDT_OK;
    for (int i = 0; st == MDT_OK && i < mdt_tensor_set_count(r->tensors); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(r->tensors, i, &name);
        const mdt_tensor *k = mdt_tensor_set_get(kept, name);
        st = mdt_tensor_set_add_copy(in, name, k ? k : t);
    }
    for (int i = 0; st == MDT_OK && i < mdt_tensor_set_count(kept); i++) {
        const char *name;
        const mdt_tensor *k = mdt_tensor_set_at(kept, i, &name);
        if (!mdt_tensor_set_get(in, name))
            st = mdt_tensor_set_add_copy(in, name, k);
    }
    if (st != MDT_OK) {
        mdt_tensor_set_free(in);
        return st;
    }
    *out = in;
    return MDT_OK;
}

static int leader_of_group1(const mdt_mesh *mesh) {
    const mdt_layout l = {mesh->C, mesh->T, mesh->R, mesh->U, NULL};
    for (int r = 0; r < mesh->world_size; r++) {
        mdt_coords co;
        mdt_mesh_coords(r, &l, mesh->order, &co);
        if (co.cfg == 1 && co.tp == 0 && co.ring == 0 && co.ulysses == 0)
            return r;
    }
    return -1;
}

/* Moves `n` bytes at `buf` from world rank `from` to world rank `to` over the server's
 * communicator in CHUNK_BYTES pieces, each wait watched as the forward's are. */
static mdt_status spec_move(serve_ctx *c, void *buf, int64_t n, int from, int to) {
    for (int64_t off = 0; off < n; off += CHUNK_BYTES) {
        const int len = (int)(n - off < CHUNK_BYTES ? n - off : CHUNK_BYTES);
        MPI_Request rq;
        const int rc =
            c->rank == from
                ? MPI_Isend((char *)buf + off, len, MPI_BYTE, to, k_tag_spec, c->comm, &rq)
                : MPI_Irecv((char *)buf + off, len, MPI_BYTE, from, k_tag_spec, c->comm, &rq);
        if (rc != MPI_SUCCESS)
            return MDT_FAIL(MDT_E_MPI, "serve: moving the other branch's outputs failed");
        MDT_TRY(mdt_mesh_wait(c->mesh, c->comm, 1, &rq, "the other branch's outputs"));
    }
    return MDT_OK;
}

/* Group 1's leader hands its outputs (a blob) to rank 0, which reads them into *dst; with a
 * step cache (`step`, every rank alike), its decision too, into *step_dst. */
static mdt_status spec_send(serve_ctx *c, const mdt_tensor_set *sout, mdt_tensor_set **dst,
                            const mdt_cache_step *step, mdt_cache_step *step_dst) {
    if (!c->spec_leader && c->rank != 0)
        return MDT_OK;
    unsigned char *blob = NULL;
    size_t n = 0;
    int64_t size = -1;
    mdt_status st = MDT_OK;
    if (c->spec_leader && (st = mdt_tensor_set_serialize(sout, NULL, &blob, &n)) == MDT_OK)
        size = (int64_t)n;
    mdt_status mv = spec_move(c, &size, (int64_t)sizeof size, c->leader1, 0);
    /* rank 0 says whether it can take them: the leader sends only then, so no piece is left
     * pending for a later receive to match */
    int ok = 1;
    if (mv == MDT_OK && size > 0 && c->rank == 0 && !(blob = mdt_alloc((size_t)size))) {
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory for the other branch's outputs");
        ok = 0;
    }
    if (mv == MDT_OK && size > 0)
        mv = spec_move(c, &ok, (int64_t)sizeof ok, 0, c->leader1);
    if (mv == MDT_OK && size > 0 && ok)
        mv = spec_move(c, blob, size, c->leader1, 0);
    if (st == MDT_OK)
        st = mv;
    if (mv == MDT_OK && step) { /* the same bytes on both ends: one binary, one struct */
        mdt_cache_step e = *step;
        mv = spec_move(c, &e, (int64_t)sizeof e, c->leader1, 0);
        if (c->rank == 0)
            *step_dst = e;
        st = st == MDT_OK ? mv : st;
    }
    if (st == MDT_OK && c->rank == 0 && size < 0)
        st = MDT_FAIL(MDT_E_NOMEM, "the other cfg group could not serialize its outputs");
    if (st == MDT_OK && c->rank == 0) {
        mdt_st_file *f = NULL;
        st = mdt_st_open_mem(blob, (size_t)size, "the other branch's outputs", &f);
        if (st == MDT_OK)
            st = mdt_st_read_set(f, dst);
        mdt_st_close(f);
    }
    mdt_free(blob);
    return st;
}

/* *out (new): every output of `a` (batch rows first) followed by the same output's rows in `b`:
 * the two groups' parts of a split batch, in order. */
static mdt_status cat_rows(const mdt_tensor_set *a, const mdt_tensor_set *b, mdt_tensor_set **out) {
    MDT_TRY(mdt_tensor_set_create(out));
    mdt_status st = MDT_OK;
    for (int i = 0; st == MDT_OK && i < mdt_tensor_set_count(a); i++) {
        const char *name;
        const mdt_tensor *x = mdt_tensor_set_at(a, i, &name), *y = mdt_tensor_set_get(b, name);
        if (!y || x->ndim < 1 || y->ndim != x->ndim || x->dtype != y->dtype ||
            memcmp(x->shape + 1, y->shape + 1, sizeof(int64_t) * (size_t)(x->ndim - 1)) != 0) {
            st = MDT_FAIL(MDT_E_INVALID,
                          "serve: the two cfg groups' parts of output '%s' do not "
                          "join along the batch",
                          name);
            break;
        }
        int64_t shape[MDT_MAX_DIMS];
        memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
        shape[0] = x->shape[0] + y->shape[0];
        mdt_tensor *t;
        st = mdt_tensor_set_add(*out, name, x->dtype, x->ndim, shape, &t);
        if (st == MDT_OK) {
            memcpy(t->data, x->data, (size_t)mdt_tensor_nbytes(x));
            memcpy((char *)t->data + mdt_tensor_nbytes(x), y->data, (size_t)mdt_tensor_nbytes(y));
        }
    }
    if (st != MDT_OK) {
        mdt_tensor_set_free(*out);
        *out = NULL;
    }
    return st;
}

/* A forward: the session's kept tensors merged in, every rank's verdict agreed before and after.
 * A failure is a reply (the forward's own message), not an end of the server, unless the peers
 * are stuck (then the caller ends the job). */
static mdt_status op_forward(serve_ctx *c, mdt_serve_request *r, unsigned char **reply, size_t *rn,
                             mdt_status *fatal) {
    mdt_tensor_set *out = NULL;
    mdt_device_info d;
    mdt_device_info_get(&d);
    mdt_cache *cache = NULL;
    mdt_status st = r->cfg_next[0] && c->C != 2
                        ? MDT_FAIL(MDT_E_INVALID, "request: \"cfg_next\" needs a server started "
                                                  "with --cfg 2 (this one has one cfg group)")
                        : mdt_serve_sessions_prepare(&c->ss, r);
    if (st == MDT_OK) /* the generation's step cache, its branch selected (every rank alike) */
        st = mdt_serve_caches_use(&c->cs, r, &cache);
    if (st == MDT_OK) /* this forward's activations too, before it runs (run's check) */
        st = mdt_serve_budget_check(&c->budget, c->m, r->tensors, d.gpu);
    if (st == MDT_OK)
        st = mdt_tensor_set_create(&out);
    st = mdt_mesh_agree(c->mesh, st);
    double secs = 0, fuse_s = -1;
    /* --cfg 2: the other branch of the last request, computed with it, if these are its inputs
     * byte for byte (and its adapters, and its cache generation and branch); every rank holds
     * the same and decides alike */
    char lk[MDT_SERVE_LORA_KEY];
    lora_key(r, lk, sizeof lk);
    const int same_cache =
        cache ? c->spec_gen[0] && strcmp(r->cache_gen, c->spec_gen) == 0 &&
                    strcmp(r->cache_context, c->spec_ctx) == 0 &&
                    mdt_serve_caches_serial_of(&c->cs, r->cache_gen) == c->spec_serial
              : !c->spec_gen[0];
    const int hit = st == MDT_OK && c->spec_in && same_cache && strcmp(lk, c->spec_lora) == 0 &&
                    sets_equal(r->tensors, c->spec_in);
    mdt_tensor_set *sin = NULL, *sout = NULL;
    if (st == MDT_OK && !hit && c->C == 2) /* a new request: any earlier one is stale */
        spec_drop(c);
    /* with a step cache: the group that holds the request's branch runs it */
    const int rgrp = st == MDT_OK ? branch_group(c, cache) : 0;
    const int rb = cache ? cache->cur : -1;
    if (st == MDT_OK && !hit && c->C == 2 && r->cfg_next[0] && rgrp == 0) {
        mdt_status sp = spec_inputs(c, r, cache, &sin);
        if (sp == MDT_OK && sin && cache) {
            /* its branch, if the generation has it on group 1, or makes it there as its
             * second (a generation's first step: at most one branch made so, so a client's
             * wrong guess cannot use up the generation's branches); each group's forward
             * tentative until both succeed */
            const char *ctx = mdt_serve_sessions_context_of(&c->ss, r->cfg_next);
            int sb = mdt_cache_find(cache, ctx);
            if (sb < 0 && cache->nbranches == 1 && rb == 0 &&
                mdt_cache_select(cache, ctx) == MDT_OK)
                sb = cache->cur;
            if (sb >= 0 && sb % 2 == 1) {
                cache->cur = c->grp == 1 ? sb : rb;
                sp = mdt_cache_tentative(cache);
                snprintf(c->spec_gen, sizeof c->spec_gen, "%s", r->cache_gen);
                snprintf(c->spec_ctx, sizeof c->spec_ctx, "%s", cache->br[sb].name);
                c->spec_serial = mdt_serve_caches_serial_of(&c->cs, r->cache_gen);
            } else { /* not yet, or on group 0 too: one after the other */
                mdt_tensor_set_free(sin);
                sin = NULL;
            }
        }
        if (sp == MDT_OK && sin)
            sp = mdt_serve_budget_check(&c->budget, c->m, sin, d.gpu);
        if (sp == MDT_OK && sin)
            sp = mdt_tensor_set_create(&sout);
        if (mdt_mesh_agree(c->mesh, sp) != MDT_OK) { /* optional: the request runs alone */
            if (mdt_mesh_peers_stuck(c->mesh))
                st = *fatal = MDT_E_MPI;
            mdt_tensor_set_free(sin), mdt_tensor_set_free(sout);
            sin = sout = NULL;
            if (cache) {
                mdt_cache_rollback(cache);
                cache->cur = rb, c->spec_gen[0] = c->spec_ctx[0] = '\0';
            }
        }
    }
    if (st == MDT_OK && !hit && rgrp == 1) { /* group 1 computes the request, group 0 waits;
                                              * its step kept once rank 0 has the outputs */
        mdt_status sp = c->grp == 1 ? mdt_tensor_set_create(&sout) : MDT_OK;
        if (sp == MDT_OK)
            sp = mdt_cache_tentative(cache);
        st = mdt_mesh_agree(c->mesh, sp);
    }
    /* --cfg 2 and nothing to compute for the other branch: a batch of B >= 2 is cut between
     * the groups (rows [0, B/2) on group 0, the rest on group 1), joined on rank 0 */
    mdt_tensor_set *part = NULL, *other = NULL;
    const int64_t B = st == MDT_OK && !hit && !sin && c->C == 2 && !cache
                          ? mdt_model_batch_of(c->m, r->tensors)
                          : 0;
    if (B >= 2) {
        int64_t b0, nb;
        mdt_split_range(B, 2, c->grp, &b0, &nb);
        mdt_status sp = mdt_model_inputs_rows(c->m, r->tensors, B, b0, nb, &part);
        if (sp == MDT_OK && c->grp == 1)
            sp = mdt_tensor_set_create(&sout);
        st = mdt_mesh_agree(c->mesh, sp);
    }
    if (st == MDT_OK && !hit) { /* the adapters it names (collective, agreed) */
        st = use_adapters(c, r, &fuse_s);
        if (st != MDT_OK && mdt_mesh_peers_stuck(c->mesh))
            *fatal = st;
    }
    /* the groups run different forwards: a rank whose forward fails at once (its inputs'
     * checks) waits in the failure agreement for the other group's, which is busy, not stuck */
    if ((sin || part) && c->mesh)
        c->mesh->agree_wait_s = mdt_model_step_bound(c->m);
    for (int attempt = 0; st == MDT_OK && !hit && attempt < 2; attempt++) {
        const double t0 = now_s();
        c->m->cache = cache;
        if (part) /* a split batch: this group's rows */
            st = mdt_model_forward(c->m, part, c->grp == 0 ? out : sout);
        else if (c->grp == rgrp) /* the request (group 0 without cfg) */
            st = mdt_model_forward(c->m, r->tensors, rgrp == 0 ? out : sout); /* guarded, agreed */
        else if (sin)
            st = mdt_model_forward(c->m, sin, sout);
        else
            st = mdt_model_sit_out(c->m, MDT_OK);
        c->m->cache = NULL;
        secs = now_s() - t0;
        if (st != MDT_OK && mdt_mesh_peers_stuck(c->mesh))
            *fatal = st;
        if (sin && cache && st == MDT_OK && c->grp == 0)
            mdt_cache_commit(cache); /* the request's own step stays; group 1's waits */
        if (st == MDT_OK || *fatal != MDT_OK || !sin)
            break;
        /* it may be the other branch's inputs that failed: the request alone once more, from
         * the cache state before this attempt */
        if (cache) {
            mdt_cache_rollback(cache);
            cache->cur = rb, c->spec_gen[0] = c->spec_ctx[0] = '\0';
        }
        mdt_tensor_set_free(sin), mdt_tensor_set_free(sout), mdt_tensor_set_free(out);
        sin = sout = out = NULL;
        st = mdt_mesh_agree(c->mesh, mdt_tensor_set_create(&out));
    }
    if (c->mesh)
        c->mesh->agree_wait_s = 0;
    if (cache && st != MDT_OK) { /* nothing of a failed request's cache step is kept */
        mdt_cache_rollback(cache);
        c->spec_gen[0] = c->spec_ctx[0] = '\0';
    }
    if (cache)
        cache->cur = rb;
    mdt_cache_step remote = {0}; /* rank 0: the decision of a forward group 1 ran */
    if (st == MDT_OK && sin) {   /* group 1's outputs to rank 0, kept for the next request */
        const mdt_status sp = mdt_mesh_agree(
            c->mesh, spec_send(c, sout, &c->spec_out, cache ? &cache->last : NULL, &c->spec_step));
        if (sp == MDT_OK) {
            c->spec_in = sin, sin = NULL;
            snprintf(c->spec_lora, sizeof c->spec_lora, "%s", lk);
            c->cfg_speculated++;
        } else {
            if (mdt_mesh_peers_stuck(c->mesh))
                st = *fatal = sp;
            spec_drop(c);
        }
    }
    if (st == MDT_OK && !hit && rgrp == 1) { /* the request's outputs, from group 1 */
        mdt_tensor_set *got = NULL;
        st = mdt_mesh_agree(c->mesh, spec_send(c, sout, &got, &cache->last, &remote));
        if (st == MDT_OK)
            mdt_cache_commit(cache);
        else
            mdt_cache_rollback(cache);
        if (st == MDT_OK && c->rank == 0) {
            mdt_tensor_set_free(out);
            out = got, got = NULL;
        } else if (st != MDT_OK && mdt_mesh_peers_stuck(c->mesh)) {
            *fatal = st;
        }
        mdt_tensor_set_free(got);
    }
    if (st == MDT_OK && part) { /* group 1's rows to rank 0, after group 0's */
        st = mdt_mesh_agree(c->mesh, spec_send(c, sout, &other, NULL, NULL));
        mdt_tensor_set *whole = NULL;
        if (st == MDT_OK && c->rank == 0)
            st = cat_rows(out, other, &whole);
        st = mdt_mesh_agree(c->mesh, st);
        if (st == MDT_OK && c->rank == 0) {
            mdt_tensor_set_free(out);
            out = whole;
        } else if (mdt_mesh_peers_stuck(c->mesh)) {
            *fatal = st;
        }
    }
    mdt_tensor_set_free(part), mdt_tensor_set_free(other);
    mdt_tensor_set_free(sin), mdt_tensor_set_free(sout);
    if (hit) {
        c->cfg_hits++;
        secs = 0; /* no forward ran for this request: the last one's computed it */
    }
    if (st == MDT_OK) {
        const int64_t before = mdt_serve_sessions_bytes_of(&c->ss, r->session);
        st = mdt_mesh_agree(c->mesh, mdt_serve_sessions_commit(&c->ss, r));
        if (st != MDT_OK && r->session[0] &&
            before != mdt_serve_sessions_bytes_of(&c->ss, r->session))
            mdt_serve_sessions_end(&c->ss, r->session); /* some ranks stored it: none keeps it */
    }
    const int answered = st == MDT_OK; /* agreed: every rank alike */
    /* the decision this forward's reply gives: of the concurrent forward, of group 1's, or
     * of this rank's own */
    const mdt_cache_step *rec = !cache      ? NULL
                                : hit       ? &c->spec_step
                                : rgrp == 1 ? &remote
                                            : &cache->last;
    if (c->rank == 0) {
        if (st != MDT_OK)
            st = mdt_serve_reply_error("forward", r->id, mdt_last_error(), st, reply, rn);
        else {
            char sec[32], got[32], kept[32], cdiff[40] = "", cran[24] = "", cskip[24] = "",
                                             csaved[40] = "", fuse[32] = "";
            if (fuse_s >= 0)
                snprintf(fuse, sizeof fuse, "%.6f", fuse_s);
            if (rec) {
                const mdt_cache_step *e = rec;
                snprintf(cdiff, sizeof cdiff, "%.17g", e->diff);
                snprintf(cran, sizeof cran, "%lld", (long long)e->blocks_run);
                snprintf(cskip, sizeof cskip, "%lld", (long long)e->blocks_skip);
                snprintf(csaved, sizeof csaved, "%.17g", e->flops_saved);
            }
            const int64_t held = mdt_serve_sessions_bytes_of(&c->ss, r->session);
            const char *cfgv = hit ? "hit" : B >= 2 ? "split" : c->C == 2 ? "computed" : "";
            const char *specv = !hit && c->spec_in ? "1" : "";
            snprintf(sec, sizeof sec, "%.6f", secs);
            snprintf(got, sizeof got, "%lld", (long long)r->bytes);
            snprintf(kept, sizeof kept, "%lld", (long long)held);
            /* the session's token: the client names it in later forwards (absent once ended) */
            const char *meta[] = {"op",
                                  "forward",
                                  "id",
                                  r->id,
                                  "session",
                                  held > 0 ? r->session : "",
                                  "step_seconds",
                                  sec,
                                  "bytes_received",
                                  got,
                                  "session_bytes",
                                  kept,
                                  "lora_fuse_seconds",
                                  fuse,
                                  "cfg",
                                  cfgv,
                                  "cfg_speculated",
                                  specv,
                                  rec ? "cache_skipped" : NULL,
                                  rec && rec->skipped ? "1" : "0",
                                  "cache_diff",
                                  cdiff,
                                  "cache_blocks_computed",
                                  cran,
                                  "cache_blocks_skipped",
                                  cskip,
                                  "cache_flops_saved",
                                  csaved,
                                  NULL};
            st = mdt_serve_reply_ok(meta, hit ? c->spec_out : out, reply, rn);
        }
    } else {
        st = MDT_OK;
    }
    if (hit) /* answered: the speculation is spent (its cache step kept if the reply is ok) */
        spec_end(c, answered);
    mdt_tensor_set_free(out);
    return st;
}

/* Runs one request on every rank; *reply on rank 0. A status other than MDT_OK ends the
 * server (only *fatal failures and failures to build the reply). */
static mdt_status run_request(serve_ctx *c, mdt_serve_request *r, unsigned char **reply, size_t *rn,
                              mdt_status *fatal) {
    const char *meta[] = {"op", r->op_name, "id", r->id, NULL};
    switch (r->op) {
    case MDT_SERVE_OP_INFO: return op_info(c, r, reply, rn);
    case MDT_SERVE_OP_FORWARD: return op_forward(c, r, reply, rn, fatal);
    case MDT_SERVE_OP_END_SESSION:
        if (r->session[0])
            mdt_serve_sessions_end(&c->ss, r->session);
        if (r->cache_gen[0] && strcmp(r->cache_gen, c->spec_gen) == 0)
            spec_drop(c); /* computed in that generation: it must not answer a later one */
        if (r->cache_gen[0])
            mdt_serve_caches_end(&c->cs, r->cache_gen);
        return c->rank == 0 ? mdt_serve_reply_ok(meta, NULL, reply, rn) : MDT_OK;
    case MDT_SERVE_OP_CLOSE:
        return c->rank == 0 ? mdt_serve_reply_ok(meta, NULL, reply, rn) : MDT_OK;
    case MDT_SERVE_OP_LORA_LOAD: return op_lora_load(c, r, reply, rn);
    case MDT_SERVE_OP_LORA_UNLOAD: return op_lora_unload(c, r, reply, rn);
    case MDT_SERVE_OP_STOP:
    case MDT_SERVE_OP_HEARTBEAT: break;
    }
    return MDT_OK;
}

/* ---- rank 0's requests ---- */

/* Hands an error reply to the client `conn` (the listener writes it). */
static void reply_error(serve_ctx *c, uint64_t conn, const char *op, const char *rid,
                        const char *msg, mdt_status code) {
    unsigned char *b = NULL;
    size_t n = 0;
    if (mdt_serve_reply_error(op, rid, msg, code, &b, &n) == MDT_OK)
        mdt_serve_listener_reply(c->l, conn, b, n);
}

/* Rank 0: waits for the next valid request (answering invalid ones itself), a stop, or the time
 * for a heartbeat. On return *r holds the request and *in the message it came in, or hdr[H_OP]
 * is MDT_SERVE_OP_STOP or MDT_SERVE_OP_HEARTBEAT. */
static mdt_status next_request(serve_ctx *c, mdt_serve_request *r, mdt_serve_incoming *in,
                               int64_t hdr[MDT_SERVE_HDR]) {
    const double due = c->last_header + heartbeat_s(c);
    for (;;) {
        MDT_TRY(take_notes(c));
        if (g_stop || c->stop) {
            hdr[H_OP] = MDT_SERVE_OP_STOP;
            return MDT_OK;
        }
        const double left = due - now_s();
        if (left <= 0 && c->world > 1) {
            hdr[H_OP] = MDT_SERVE_OP_HEARTBEAT;
            return MDT_OK;
        }
        const int wait_ms = left * 1000 < k_poll_ms && left > 0 ? (int)(left * 1000) : k_poll_ms;
        if (!mdt_serve_listener_next(c->l, wait_ms, in))
            continue;
        const mdt_status pst = mdt_serve_request_parse(in->blob, in->size, r);
        if (pst != MDT_OK) {
            reply_error(c, in->conn, r->op_name, r->id, mdt_last_error(), pst);
            mdt_serve_request_free(r);
            mdt_serve_listener_done(c->l, in);
            continue;
        }
        uint64_t token[2] = {0, 0};
        const mdt_status tst = r->new_session ? mdt_serve_token_new(token) : MDT_OK;
        if (tst != MDT_OK) {
            reply_error(c, in->conn, r->op_name, r->id, mdt_last_error(), tst);
            mdt_serve_request_free(r);
            mdt_serve_listener_done(c->l, in);
            continue;
        }
        hdr[H_OP] = r->op, hdr[H_BYTES] = r->bytes;
        memcpy(&hdr[H_WORD0], token, sizeof token); /* every rank names the session alike */
        return MDT_OK;
    }
}

/* ---- the loop ---- */

/* One turn on every rank: the next request (or stop, or heartbeat) from rank 0, run, replied.
 * Every wait of it is watched (the loop's bound): a rank that stopped or died ends the turn with
 * the watchdog's line and mdt_mesh_peers_stuck set, which makes it *fatal (the job is ended;
 * rank 0 replies the line to the waiting client first). *done set on close or stop. */
static mdt_status serve_one(serve_ctx *c, int *done, mdt_status *fatal) {
    mdt_serve_request r;
    memset(&r, 0, sizeof r);
    mdt_serve_incoming in;
    memset(&in, 0, sizeof in);
    int have_msg = 0;
    int64_t hdr[MDT_SERVE_HDR] = {0};
    unsigned char *blob = NULL, *reply = NULL;
    size_t rn = 0;
    mdt_status st = MDT_OK;
    mdt_mesh_set_deadline(c->mesh, loop_bound(c)); /* (a forward disarms it when it ends) */
    if (c->rank == 0) {
        st = next_request(c, &r, &in, hdr);
        have_msg =
            st == MDT_OK && hdr[H_OP] != MDT_SERVE_OP_STOP && hdr[H_OP] != MDT_SERVE_OP_HEARTBEAT;
        if (st != MDT_OK) /* the loop failed: every rank stops, rank 0 says why */
            hdr[H_OP] = MDT_SERVE_OP_STOP;
        hdr[H_NOW_MS] = (int64_t)(now_s() * 1000);
        c->last_header = now_s();
    }
    const mdt_status local = st;
    if ((st = bcast_header(c, hdr)) != MDT_OK) {
        *fatal = st;
        goto reply;
    }
    if (hdr[H_OP] == MDT_SERVE_OP_STOP) {
        *done = 1;
        st = local;
        c->ended_by = local == MDT_OK ? ENDED_STOP : 0;
        goto out;
    }
    mdt_serve_sessions_expire(&c->ss, hdr[H_NOW_MS]); /* the same clock on every rank */
    mdt_serve_caches_expire(&c->cs, hdr[H_NOW_MS]);
    if (hdr[H_OP] == MDT_SERVE_OP_HEARTBEAT) { /* every rank shows it is there */
        if ((st = mdt_mesh_barrier(c->mesh, "idle heartbeat")) != MDT_OK)
            *fatal = st;
        goto out;
    }
    /* the blob: every rank makes room (agreed), then it is broadcast and parsed */
    if (c->rank == 0)
        blob = in.blob;
    else if (!(blob = mdt_alloc((size_t)(hdr[H_BYTES] ? hdr[H_BYTES] : 1))))
        st = MDT_FAIL(MDT_E_NOMEM, "rank %d: no memory for a request of %lld bytes", c->rank,
                      (long long)hdr[H_BYTES]);
    st = mdt_mesh_agree(c->mesh, st);
    if (st == MDT_OK) {
        if ((st = bcast_blob(c, blob, hdr[H_BYTES])) != MDT_OK) {
            *fatal = st;
            goto reply;
        }
        if (c->rank != 0)
            st = mdt_serve_request_parse(blob, (size_t)hdr[H_BYTES], &r);
        st = mdt_mesh_agree(c->mesh, st);
    }
    r.now_ms = hdr[H_NOW_MS];
    if (st == MDT_OK && r.new_session) { /* the token rank 0 drew replaces "new" everywhere */
        uint64_t token[2];
        memcpy(token, &hdr[H_WORD0], sizeof token);
        mdt_serve_token_text(token, r.session);
    }
    if (st == MDT_OK && !mdt_mesh_peers_stuck(c->mesh)) {
        /* a stop signal now ends the request at its next wait (every rank, the job ends), and
         * rank 0's listener ends the server if the request outlasts the stop's grace */
        mdt_mesh_set_interruptible(c->mesh, 1);
        if (c->rank == 0)
            mdt_serve_listener_busy(c->l, in.conn, r.op_name, r.id, 1);
        st = run_request(c, &r, &reply, &rn, fatal);
        if (c->rank == 0)
            mdt_serve_listener_busy(c->l, in.conn, NULL, NULL, 0);
        mdt_mesh_set_interruptible(c->mesh, 0);
        mdt_mesh_set_deadline(c->mesh, loop_bound(c)); /* the forward disarmed it */
    } else if (c->rank == 0)
        st = mdt_serve_reply_error(r.op_name, r.id, mdt_last_error(), st, &reply, &rn);
reply:
    if (mdt_mesh_peers_stuck(c->mesh) && *fatal == MDT_OK)
        *fatal = st != MDT_OK ? st : MDT_E_MPI; /* a rank stalled or failed: the message stands */
    if (c->rank == 0 && have_msg && *fatal != MDT_OK && !reply) /* the client gets the reason */
        mdt_serve_reply_error(r.op_name, r.id, mdt_last_error(), *fatal, &reply, &rn);
    if (c->rank == 0 && reply) {
        mdt_serve_listener_reply(c->l, in.conn, reply, rn); /* the listener frees it */
        reply = NULL;
    }
    if (*fatal == MDT_OK)
        st = mdt_mesh_agree(c->mesh, st); /* building a reply failed: stop everywhere */
    if (mdt_mesh_peers_stuck(c->mesh) && *fatal == MDT_OK)
        *fatal = st != MDT_OK ? st : MDT_E_MPI;
    *done = st != MDT_OK || *fatal != MDT_OK || hdr[H_OP] == MDT_SERVE_OP_CLOSE;
    if (st == MDT_OK && *fatal == MDT_OK && hdr[H_OP] == MDT_SERVE_OP_CLOSE)
        c->ended_by = ENDED_CLOSE;
out:
    if (have_msg)
        mdt_serve_listener_done(c->l, &in); /* rank 0's blob lives in it */
    if (c->rank != 0)
        mdt_free(blob);
    mdt_free(reply);
    mdt_serve_request_free(&r);
    return st;
}

/* Rank 0, the loop ended on a stop or a close: the requests still queued (on one rank, those
 * that came while a forward ran; on any, those that came while the stop spread) and those that
 * arrive before the listener closes are answered with why, not dropped with their
 * connection. */
static void answer_queued(serve_ctx *c) {
    const char *why =
        c->ended_by == ENDED_CLOSE
            ? "the server was closed (a close request) before this request ran"
        : mdt_serve_listener_owner_gone(c->l)
            ? "stopped: the server's standard input ended (--owner-stdin: the process that "
              "started it is gone) before this request ran: the server is ending"
            : "stopped by a signal (SIGTERM or SIGINT) before this request ran: the server is "
              "ending";
    mdt_serve_listener_fail_all(c->l, why, 1.0);
}

mdt_status mdt_serve(mdt_model *m, const mdt_serve_params *p) {
    serve_ctx c;
    memset(&c, 0, sizeof c);
    c.m = m, c.p = p, c.mesh = m->mesh;
    c.comm = MPI_COMM_NULL;
    c.rank = c.mesh ? c.mesh->world_rank : 0;
    c.world = c.mesh ? c.mesh->world_size : 1;
    mdt_status st = mdt_serve_sessions_init(&c.ss, p->max_sessions, p->max_session_bytes,
                                            (int64_t)(p->session_idle * 1000));
    if (st == MDT_OK)
        st = mdt_serve_caches_init(&c.cs, p->max_sessions, (int64_t)(p->session_idle * 1000));
    if (st == MDT_OK && c.rank == 0 && c.world > 1 &&
        !(c.notes_recv = mdt_calloc(sizeof(int) * (size_t)c.world)))
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    mdt_model_set_step_timeout(m, p->step_timeout);
    note_startup_adapters(&c);
    if (st == MDT_OK)
        st = mdt_serve_budget_init(&c.budget, m, p);
    if (c.mesh && MPI_Comm_dup(c.mesh->world, &c.comm) != MPI_SUCCESS)
        st = MDT_FAIL(MDT_E_MPI, "serve: duplicating the world communicator failed");
    c.C = c.mesh ? c.mesh->C : 1, c.grp = c.mesh ? c.mesh->c : 0;
    c.spec_leader = c.C == 2 && c.grp == 1 && c.mesh->t == 0 && c.mesh->r == 0 && c.mesh->u == 0;
    if (c.C == 2) /* group 1's leader: cfg coordinate 1, every other 0 (no collective) */
        c.leader1 = leader_of_group1(c.mesh);
    if (st == MDT_OK && c.rank == 0) {
        c.l = p->listener;
        if (!c.l && (st = mdt_serve_listen(p, &c.l)) == MDT_OK)
            c.own_listener = 1;
    }
    st = mdt_mesh_agree(c.mesh, st);
    if (st == MDT_OK && c.rank == 0 && p->on_ready)
        p->on_ready(p->user, mdt_serve_listener_endpoint(c.l));
    mdt_status fatal = MDT_OK;
    c.last_header = now_s();
    for (int done = 0; st == MDT_OK && !done;)
        st = serve_one(&c, &done, &fatal);
    if (fatal != MDT_OK) {
        st = fatal;      /* no agreement possible: the caller ends the job */
        if (c.rank == 0) /* clients still waiting get the reason, not a dropped connection */
            mdt_serve_listener_fail_all(c.l, mdt_last_error(), 1.0);
    } else {
        const mdt_status dn = drain_notes(&c);
        st = mdt_mesh_agree(c.mesh, st != MDT_OK ? st : dn);
        if (st == MDT_OK && c.rank == 0 && c.ended_by)
            answer_queued(&c);
    }
    if (c.own_listener)
        mdt_serve_listener_free(c.l);
    if (c.comm != MPI_COMM_NULL)
        MPI_Comm_free(&c.comm);
    mdt_serve_sessions_free(&c.ss);
    spec_drop(&c); /* first: it undoes a tentative cache step of a generation held there */
    mdt_serve_caches_free(&c.cs);
    mdt_free(c.notes_recv);
    return st;
}
