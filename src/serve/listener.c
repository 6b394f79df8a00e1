/*
 * listener.c — world rank 0's connections (meshdit.h: mdt_serve_listen), on a thread of their
 * own: it accepts ZeroMQ clients on the bound socket, speaks ZMTP with each (zmtp.h), answers
 * their heartbeats, reads their messages frame by frame as the bytes arrive, queues the valid
 * requests for the server loop (serve.c) and writes the replies it is handed. Running beside the
 * loop, it keeps doing so while a forward computes: a message is bounded as it arrives, not after.
 *
 * What rank 0 ever holds for clients, whatever they send:
 *   - per message: one blob of at most --max-request-bytes, grown as its bytes arrive (never to
 *     the size a frame header merely announces); a request of another shape (a frame past the
 *     second, a non-empty delimiter) or size is read on but not kept, and answered with an error
 *     reply once it has ended; a message that gets no byte for the message timeout while partly
 *     read closes its connection (what it held is released), and so does a connection that,
 *     with messages partly read, falls behind the minimum rate (--min-rate) by more than the
 *     message timeout (a leaky bucket over the connection: rate_bucket);
 *   - in all: the blobs being received, queued or run and the replies not yet written, at most
 *     --max-queue-bytes, blobs counted as their buffers grow; a request whose bytes would pass
 *     it is refused then (an error reply: retry later). A reply is counted from the moment the
 *     loop hands it over until its last byte is written (it cannot be refused: it may take the
 *     total past the bound, and requests are refused until it is written);
 *   - per connection: MDT_SERVE_CLIENT_QUEUE requests queued, running or with a reply not yet
 *     written (more are refused), so a client that never reads its replies holds at most that
 *     many, and one that reads them below the minimum rate is closed after the grace (the
 *     same bucket as for what it sends, kept apart); a connection whose unwritten replies hold
 *     more than a quarter of --max-queue-bytes is not read (no new request of it is taken)
 *     until they are written; and at most 64 small error replies unwritten (then the
 *     connection is closed);
 *   - MDT_SERVE_MAX_CLIENTS connections. One that has not finished its greeting and READY within
 *     the handshake timeout is closed; when the table is full, a newcomer takes the place of the
 *     connection idle longest among those with nothing under way (no message partly read, no
 *     request queued or running, nothing unwritten), else of the one whose message being read
 *     was already refused and that has nothing else under way, else it is closed as it comes.
 * Requests of a connection that closes before they ran are dropped unrun. An error reply the
 * listener writes itself (a refusal, a stop) names the request's op and id when its header lies
 * within the first MDT_SERVE_PEEK_BYTES of its blob (a message that is not [empty, blob] has
 * none).
 *
 * The thread does no MPI and blocks the stop signals (the main thread takes them). Shared with
 * the loop under one mutex: the request queue, the bytes held, the replies handed over, the quit
 * flag; a pipe wakes the thread's poll.
 */
#define _GNU_SOURCE
#include "serve/serve.h"
#include "comm/mesh.h"
#include "serve/zmtp.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { READ_CHUNK = 1 << 18, MAX_SMALL_OUT = 64 };

/* The minimum rate (--min-rate) of one direction of a connection, as a leaky bucket over its
 * life, not per message: seconds of credit as of `at`. Time with a message partly read (in) or
 * output waiting to be written (out) spends it, every min_rate bytes moved earn a second, and
 * time with nothing under way in that direction earns it back second for second; it never
 * exceeds the grace. So messages sent back to back, a burst banked before a trickle, or replies
 * read a few bytes at a time buy no time. Closed when it runs out while under way. */
typedef struct rate_bucket {
    double credit, at;
} rate_bucket;

typedef struct out_item {
    struct out_item *next;
    unsigned char head[72]; /* greeting, READY, PONG, or the reply's two frame headers */
    size_t head_n;
    unsigned char *body; /* a reply blob (owned) or NULL */
    size_t body_n, off;  /* off: bytes of head + body written */
    int is_reply;        /* writing it ends one request of the connection */
    int64_t held;        /* bytes of the queue budget it holds until written or dropped */
} out_item;

typedef struct peer {
    int fd;
    uint64_t id;
    double born, last_io; /* monotonic seconds: accepted, last byte read or written */
    double last_rx;       /* monotonic seconds: last byte read */
    double last_tx;       /* monotonic seconds: last byte written, or when output began waiting */
    mdt_zmtp_reader rd;
    /* the message being read */
    uint64_t frames;    /* frames so far (64 bits: a peer cannot count it past the checks) */
    double msg_start;   /* monotonic seconds: its first frame began */
    rate_bucket rx, tx; /* the minimum rate of what it sends and of what it reads */
    uint64_t delim;     /* the first frame's size (a request's is 0) */
    int refusing;       /* not kept: answered with `refusal` at its end */
    char refusal[320];
    unsigned char head[MDT_SERVE_PEEK_BYTES]; /* the blob's first bytes, kept or not */
    size_t head_n;
    unsigned char *blob;
    size_t blob_size, blob_have, blob_cap; /* announced, arrived, allocated */
    int64_t reserved;                      /* of the queue budget: blob_cap */
    int in_flight;                         /* requests queued, running or with an unwritten reply */
    int64_t reply_bytes;                   /* bytes of its replies not yet written */
    int small_out;                         /* unwritten items that are not replies */
    out_item *out, *out_tail;
} peer;

typedef struct req_item {
    struct req_item *next;
    mdt_serve_incoming in;
} req_item;

typedef struct pending_reply {
    struct pending_reply *next;
    uint64_t conn;
    unsigned char *blob;
    size_t n;
} pending_reply;

struct mdt_serve_listener {
    int listen_fd, wake[2], owner_fd;
    char endpoint[1024], ipc_path[128];
    int64_t max_request, max_queue;
    double handshake_s; /* a connection's time for its greeting and READY (0: no bound) */
    double message_s;   /* the longest pause inside a message (0: no bound) */
    double min_rate;    /* bytes per second each way while under way, after grace (0: none) */
    double rate_grace;  /* the most credit a connection holds: the message timeout, else 30 s */
    int64_t reply_cap;  /* a connection with more unwritten reply bytes is not read */
    void (*on_stop_stuck)(void *user, const char *msg);
    void *user;
    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    req_item *q, *q_tail;
    int64_t held; /* bytes of blobs received, being received, queued or running */
    pending_reply *replies, *replies_tail;
    int quit, out_empty;
    char ending[256]; /* the server is ending (fail_all): a request that ends now gets this */
    int busy;         /* the loop runs a request of busy_conn */
    uint64_t busy_conn;
    char busy_op[16], busy_id[MDT_SERVE_NAME_MAX + 1]; /* that request's */
    double stop_seen; /* the thread's: when it first saw a stop asked while busy (0: not) */
    volatile int owner_gone;
    /* the thread's own */
    peer *conns[MDT_SERVE_MAX_CLIENTS];
    int nconns;
    uint64_t next_id;
    unsigned char *scratch;
};

static double mono_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- the minimum rate ---- */

/* Brings the bucket to `now`: the time since it was last brought is spent if the direction was
 * under way through it, earned back (up to the grace) if not. Nothing without a minimum rate. */
static void bucket_at(const mdt_serve_listener *l, rate_bucket *b, int under_way, double now) {
    const double dt = now - b->at;
    if (l->min_rate <= 0 || dt <= 0)
        return;
    b->credit += under_way ? -dt : dt;
    if (b->credit > l->rate_grace)
        b->credit = l->rate_grace;
    b->at = now;
}

/* `n` bytes moved: a second of credit for every min_rate of them, up to the grace. */
static void bucket_earn(const mdt_serve_listener *l, rate_bucket *b, size_t n) {
    if (l->min_rate <= 0)
        return;
    b->credit += (double)n / l->min_rate;
    if (b->credit > l->rate_grace)
        b->credit = l->rate_grace;
}

/* ---- outgoing ---- */

static out_item *out_new(const mdt_serve_listener *l, peer *c, const unsigned char *head,
                         size_t head_n) {
    out_item *o = mdt_calloc(sizeof *o);
    if (!o)
        return NULL;
    memcpy(o->head, head, head_n);
    o->head_n = head_n;
    if (c->out_tail) {
        c->out_tail->next = o;
    } else {
        const double now = mono_s();
        bucket_at(l, &c->tx, 0, now); /* nothing was waiting until now */
        c->out = o;
        c->last_tx = now; /* the write deadline counts from now, not from the last write */
    }
    c->out_tail = o;
    return o;
}

static void out_small(const mdt_serve_listener *l, peer *c, const unsigned char *b, size_t n) {
    if (out_new(l, c, b, n))
        c->small_out++;
}

static void release(mdt_serve_listener *l, int64_t bytes) {
    pthread_mutex_lock(&l->mu);
    l->held -= bytes;
    pthread_mutex_unlock(&l->mu);
}

/* An item is written or dropped: the connection's counts and the queue budget it held. */
static void out_done(mdt_serve_listener *l, peer *c, out_item *o) {
    if (o->is_reply)
        c->in_flight--, c->reply_bytes -= (int64_t)o->body_n;
    else
        c->small_out--;
    if (o->held)
        release(l, o->held);
    mdt_free(o->body);
    mdt_free(o);
}

/* A reply: [empty delimiter, blob] (a REQ client strips the delimiter). Takes the blob and
 * `held` bytes of the queue budget (released once it is written or dropped). */
static void out_reply(mdt_serve_listener *l, peer *c, unsigned char *blob, size_t n, int is_reply,
                      int64_t held) {
    unsigned char head[16];
    size_t k = mdt_zmtp_frame_header(0, 1, head);
    k += mdt_zmtp_frame_header(n, 0, head + k);
    out_item *o = out_new(l, c, head, k);
    if (!o) {
        mdt_free(blob);
        if (held)
            release(l, held);
        return;
    }
    o->body = blob, o->body_n = n, o->is_reply = is_reply, o->held = held;
    if (is_reply)
        c->reply_bytes += (int64_t)n;
    else
        c->small_out++;
}

/* Writes what the socket takes. 0, or -1 when the connection broke. */
static int out_flush(mdt_serve_listener *l, peer *c) {
    if (c->out)
        bucket_at(l, &c->tx, 1, mono_s()); /* output waited until now */
    while (c->out) {
        out_item *o = c->out;
        struct iovec iov[2];
        int niov = 0;
        if (o->off < o->head_n)
            iov[niov++] = (struct iovec){o->head + o->off, o->head_n - o->off};
        const size_t boff = o->off > o->head_n ? o->off - o->head_n : 0;
        if (o->body_n > boff)
            iov[niov++] = (struct iovec){o->body + boff, o->body_n - boff};
        ssize_t w = 0;
        if (niov) {
            struct msghdr mh;
            memset(&mh, 0, sizeof mh);
            mh.msg_iov = iov, mh.msg_iovlen = (size_t)niov;
            w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w < 0)
                return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
        }
        o->off += (size_t)w;
        if (w > 0) {
            c->last_io = c->last_tx = mono_s();
            bucket_earn(l, &c->tx, (size_t)w);
        }
        if (o->off < o->head_n + o->body_n)
            return 0;
        c->out = o->next;
        if (!c->out)
            c->out_tail = NULL;
        out_done(l, c, o);
    }
    return 0;
}

/* An error reply `msg` to the request whose blob begins with `head` (n bytes), naming its op and
 * id when its header lies within them; NULL on failure. */
static unsigned char *refusal_blob(const unsigned char *head, size_t n, const char *msg,
                                   size_t *size) {
    char op[16], id[MDT_SERVE_NAME_MAX + 1];
    mdt_serve_request_peek(head, n < MDT_SERVE_PEEK_BYTES ? n : MDT_SERVE_PEEK_BYTES, op, id);
    unsigned char *b = NULL;
    return mdt_serve_reply_error(op, id, msg, MDT_OK, &b, size) == MDT_OK ? b : NULL;
}

/* ---- connections ---- */

static peer *find_conn(mdt_serve_listener *l, uint64_t id) {
    for (int i = 0; i < l->nconns; i++)
        if (l->conns[i]->id == id)
            return l->conns[i];
    return NULL;
}

static void drop_message(mdt_serve_listener *l, peer *c) {
    mdt_free(c->blob);
    c->blob = NULL, c->blob_size = c->blob_have = c->blob_cap = 0;
    if (c->reserved)
        release(l, c->reserved);
    c->reserved = 0;
}

/* Closes connection i: its unwritten output, its message in progress and its requests still
 * queued (not yet run) go with it. */
static void close_conn(mdt_serve_listener *l, int i) {
    peer *c = l->conns[i];
    close(c->fd);
    for (out_item *o = c->out, *next; o; o = next) {
        next = o->next;
        out_done(l, c, o);
    }
    drop_message(l, c);
    pthread_mutex_lock(&l->mu);
    for (req_item **pp = &l->q; *pp;) {
        req_item *r = *pp;
        if (r->in.conn == c->id) {
            *pp = r->next;
            l->held -= r->in.reserved;
            mdt_free(r->in.blob);
            mdt_free(r);
        } else {
            pp = &r->next;
        }
    }
    l->q_tail = NULL;
    for (req_item *r = l->q; r; r = r->next)
        l->q_tail = r;
    pthread_mutex_unlock(&l->mu);
    mdt_free(c);
    l->conns[i] = l->conns[--l->nconns];
}

/* A connection with nothing under way: no message partly read, no request queued or running,
 * nothing of its own left to write. Closing it loses nothing (a libzmq client reconnects). */
static int conn_idle(const peer *c) { return c->frames == 0 && c->in_flight == 0 && !c->out; }

/* Bytes the peer sent that this side has not read yet (a request may have just landed). */
static int unread(const peer *c) {
    int n = 0;
    return ioctl(c->fd, FIONREAD, &n) != 0 || n > 0;
}

/* The table is full: closes the connection idle longest, if one is idle: nothing under way and
 * nothing sent but unread (closing it then would lose a request already on its way); else the
 * one whose message, already refused (too large, malformed, the server busy), began earliest,
 * among those with nothing else under way (closing it loses only that refusal): a peer
 * announcing blobs over the bound and feeding them at the minimum rate would otherwise hold its
 * place for good. One with requests queued, running or unwritten is never closed for room (they
 * would be lost); it holds its place only while it keeps up the minimum rate both ways. 1 if one
 * was closed. */
static int evict(mdt_serve_listener *l) {
    int victim = -1, refused = -1;
    for (int i = 0; i < l->nconns; i++)
        if (conn_idle(l->conns[i]) && !unread(l->conns[i]) &&
            (victim < 0 || l->conns[i]->last_io < l->conns[victim]->last_io))
            victim = i;
    for (int i = 0; i < l->nconns && victim < 0; i++) {
        const peer *c = l->conns[i];
        if (c->frames > 0 && c->refusing && c->in_flight == 0 && !c->out &&
            (refused < 0 || c->msg_start < l->conns[refused]->msg_start))
            refused = i;
    }
    if (victim < 0)
        victim = refused;
    if (victim >= 0)
        close_conn(l, victim);
    return victim >= 0;
}

static void accept_conns(mdt_serve_listener *l) {
    for (;;) {
        const int fd = accept4(l->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        if (l->nconns == MDT_SERVE_MAX_CLIENTS)
            evict(l); /* 256 silent or refused connections must not lock every client out */
        peer *c = l->nconns < MDT_SERVE_MAX_CLIENTS ? mdt_calloc(sizeof *c) : NULL;
        if (!c) { /* all busy (or out of memory): the client sees the connection close */
            close(fd);
            continue;
        }
        c->fd = fd, c->id = ++l->next_id;
        c->born = c->last_io = c->last_rx = c->rx.at = c->tx.at = mono_s();
        c->rx.credit = c->tx.credit = l->rate_grace;
        mdt_zmtp_reader_init(&c->rd);
        unsigned char g[MDT_ZMTP_GREETING_BYTES] = {0};
        out_small(l, c, g, mdt_zmtp_greeting(g));
        l->conns[l->nconns++] = c;
    }
}

/* Refuses the message being read: nothing more of it is kept; `why` is its error reply. */
static void refuse(mdt_serve_listener *l, peer *c, const char *why) {
    if (c->refusing)
        return;
    c->refusing = 1;
    snprintf(c->refusal, sizeof c->refusal, "%s", why);
    drop_message(l, c);
}

static void frame_start(mdt_serve_listener *l, peer *c, uint64_t size) {
    char why[320];
    const uint64_t idx = c->frames++;
    if (idx == 0)
        c->msg_start = mono_s();
    if (c->refusing)
        return;
    if (idx == 0)
        c->delim = size;
    if ((idx == 0 && size != 0) || idx == 2) {
        refuse(l, c, ""); /* not [empty, blob]: the frame count is reported at the end */
    } else if (idx == 0 && c->in_flight >= MDT_SERVE_CLIENT_QUEUE) {
        snprintf(why, sizeof why,
                 "this connection has %d requests waiting for their replies, the server's limit "
                 "per client; wait for a reply before sending more",
                 c->in_flight);
        refuse(l, c, why);
    } else if (idx == 1 && (int64_t)size > l->max_request) {
        snprintf(why, sizeof why,
                 "request: a blob of %llu bytes, over the server's --max-request-bytes %lld "
                 "(refused as it arrived: nothing of it was kept)",
                 (unsigned long long)size, (long long)l->max_request);
        refuse(l, c, why);
    } else if (idx == 1) {
        /* nothing is reserved or allocated for what is only announced: a peer that announces
         * 2 GiB and stalls holds the bytes it sent (blob_grow) */
        c->blob_size = (size_t)size, c->blob_have = c->blob_cap = 0;
    }
}

/* `n` more bytes of the blob arrived: the buffer grows to hold them (doubling, up to the
 * announced size), each growth reserved against --max-queue-bytes first. 0, or -1 when the
 * message is refused (over the bound, or out of memory). */
static int blob_grow(mdt_serve_listener *l, peer *c, size_t n) {
    const size_t need = c->blob_have + n;
    if (need <= c->blob_cap)
        return 0;
    size_t cap = c->blob_cap * 2 > need ? c->blob_cap * 2 : need;
    if (cap < ((size_t)1 << 16))
        cap = (size_t)1 << 16;
    if (cap > c->blob_size)
        cap = c->blob_size;
    const int64_t more = (int64_t)(cap - c->blob_cap);
    pthread_mutex_lock(&l->mu);
    const int64_t others = l->held - c->reserved;
    const int fits = l->held + more <= l->max_queue;
    if (fits)
        l->held += more;
    pthread_mutex_unlock(&l->mu);
    if (!fits) {
        char why[320];
        snprintf(why, sizeof why,
                 "the server is busy: this request's %zu bytes would make the requests it holds "
                 "%lld bytes, over its --max-queue-bytes %lld; retry later",
                 c->blob_size, (long long)others + (long long)c->blob_size,
                 (long long)l->max_queue);
        refuse(l, c, why);
        return -1;
    }
    c->reserved += more;
    unsigned char *b = mdt_realloc(c->blob, cap); /* large blocks are remapped, not copied */
    if (!b) {
        refuse(l, c, "the server is out of memory for this request; retry later");
        return -1;
    }
    c->blob = b, c->blob_cap = cap;
    return 0;
}

/* The last frame of a message arrived: queue it, or answer it with its refusal. */
static void message_end(mdt_serve_listener *l, peer *c) {
    char why[400];
    const char *err = NULL;
    if (c->frames == 2 && c->delim != 0) { /* two frames, but the first is not a delimiter */
        snprintf(why, sizeof why,
                 "request: the delimiter frame (the first of 2) has %llu bytes: it must be empty; "
                 "a request is [empty delimiter, safetensors blob] (a REQ socket adds the "
                 "delimiter, a DEALER must send it)",
                 (unsigned long long)c->delim);
        err = why;
    } else if (c->frames != 2 || (c->refusing && !c->refusal[0])) {
        snprintf(why, sizeof why,
                 "request: %llu frame%s; a request is [empty delimiter, safetensors blob] (a REQ "
                 "socket adds the delimiter, a DEALER must send it)",
                 (unsigned long long)c->frames, c->frames == 1 ? "" : "s");
        err = why;
    } else if (c->refusing) {
        err = c->refusal;
    }
    req_item *r = NULL;
    if (!err) {
        r = mdt_calloc(sizeof *r);
        if (r && !c->blob && !(c->blob = mdt_alloc(1))) { /* an empty blob (refused by parse) */
            mdt_free(r);
            r = NULL;
        }
    }
    if (r) { /* queued, unless the server is ending: checked and queued under one lock, so
              * fail_all, which empties the queue, never misses it */
        pthread_mutex_lock(&l->mu);
        if (l->ending[0]) {
            err = strcpy(why, l->ending);
        } else {
            r->in = (mdt_serve_incoming){c->id, c->blob, c->blob_size, c->reserved};
            c->blob = NULL, c->reserved = 0;
            c->in_flight++;
            if (l->q_tail)
                l->q_tail->next = r;
            else
                l->q = r;
            l->q_tail = r;
            pthread_cond_signal(&l->cv);
        }
        pthread_mutex_unlock(&l->mu);
        if (err)
            mdt_free(r);
    } else if (!err) {
        drop_message(l, c);
    }
    if (err) {
        drop_message(l, c);
        size_t n = 0;
        unsigned char *b = refusal_blob(c->head, c->frames == 2 ? c->head_n : 0, err, &n);
        if (b)
            out_reply(l, c, b, n, 0, 0); /* a client that never reads them is closed (feed) */
    }
    c->frames = 0, c->refusing = 0, c->refusal[0] = 0, c->head_n = 0, c->delim = 0;
}

/* Feeds bytes through the connection's reader. 0, or -1 to close it. */
static int feed(mdt_serve_listener *l, peer *c, const unsigned char *p, size_t n) {
    const double now = mono_s(); /* the bytes of one read arrived at once */
    for (;;) {
        mdt_zmtp_event ev;
        const size_t used = mdt_zmtp_step(&c->rd, p, n, &ev);
        p += used, n -= used;
        if (ev.kind != MDT_ZMTP_EV_NONE) /* as of before the event */
            bucket_at(l, &c->rx, c->frames > 0, now);
        switch (ev.kind) {
        case MDT_ZMTP_EV_NONE:
            if (used == 0)
                return 0;
            break;
        case MDT_ZMTP_EV_ERROR: return -1;
        case MDT_ZMTP_EV_READY: {
            if (strcmp(c->rd.peer_type, "DEALER") != 0 && strcmp(c->rd.peer_type, "REQ") != 0)
                return -1; /* a ROUTER, PUB, ...: not a client of this server */
            unsigned char b[64] = {0};
            out_small(l, c, b, mdt_zmtp_ready(b, sizeof b));
            break;
        }
        case MDT_ZMTP_EV_PING: {
            unsigned char b[32] = {0};
            if (c->small_out >= MAX_SMALL_OUT)
                return -1; /* pings it never reads the answers of */
            out_small(l, c, b, mdt_zmtp_pong(c->rd.ping_ctx, c->rd.ping_ctx_len, b, sizeof b));
            break;
        }
        case MDT_ZMTP_EV_FRAME_START: frame_start(l, c, ev.size); break;
        case MDT_ZMTP_EV_BODY:
            bucket_earn(l, &c->rx, ev.len);
            if (c->frames == 2 && c->head_n < sizeof c->head) { /* names a refused request */
                const size_t k =
                    sizeof c->head - c->head_n < ev.len ? sizeof c->head - c->head_n : ev.len;
                memcpy(c->head + c->head_n, ev.data, k);
                c->head_n += k;
            }
            if (!c->refusing && c->frames == 2 && blob_grow(l, c, ev.len) == 0) {
                memcpy(c->blob + c->blob_have, ev.data, ev.len);
                c->blob_have += ev.len;
            }
            break;
        case MDT_ZMTP_EV_FRAME_END:
            if (!ev.more)
                message_end(l, c);
            break;
        }
        if (c->small_out > MAX_SMALL_OUT)
            return -1;
    }
}

/* ---- the thread ---- */

static void take_replies(mdt_serve_listener *l) {
    pthread_mutex_lock(&l->mu);
    pending_reply *r = l->replies;
    l->replies = l->replies_tail = NULL;
    pthread_mutex_unlock(&l->mu);
    while (r) {
        pending_reply *next = r->next;
        peer *c = find_conn(l, r->conn);
        if (c) {
            out_reply(l, c, r->blob, r->n, 1, (int64_t)r->n);
        } else { /* the client left */
            mdt_free(r->blob);
            release(l, (int64_t)r->n);
        }
        mdt_free(r);
        r = next;
    }
}

/* A stop asked while a request runs and not obeyed within the grace (one rank computing a long
 * stage, or a single rank, which has no collective to stop at): its client and every queued one
 * are answered, the replies written (at most 1 s), the socket file removed, and the caller's
 * callback ends the process. */
static void stop_stuck(mdt_serve_listener *l, uint64_t conn, const char *op, const char *id) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "stopped by a signal (SIGTERM or SIGINT) while this server ran a request, which did "
             "not end within %d s of it: the server is ending",
             MDT_SERVE_STOP_GRACE_S);
    peer *c = find_conn(l, conn);
    unsigned char *b = NULL;
    size_t n = 0;
    if (c && mdt_serve_reply_error(op, id, msg, MDT_E_STOPPED, &b, &n) == MDT_OK)
        out_reply(l, c, b, n, 0, 0); /* not its reply: the loop's own, if it comes, is that */
    pthread_mutex_lock(&l->mu);
    req_item *q = l->q;
    l->q = l->q_tail = NULL;
    pthread_mutex_unlock(&l->mu);
    for (req_item *r = q, *next; r; r = next) {
        next = r->next;
        if ((c = find_conn(l, r->in.conn)) && (b = refusal_blob(r->in.blob, r->in.size, msg, &n)))
            out_reply(l, c, b, n, 1, 0);
        release(l, r->in.reserved); /* what the queued request held of the budget */
        mdt_free(r->in.blob);
        mdt_free(r);
    }
    for (const double t0 = mono_s(); mono_s() - t0 < 1.0;) {
        int left = 0;
        for (int i = l->nconns - 1; i >= 0; i--) {
            if (out_flush(l, l->conns[i]) != 0)
                close_conn(l, i);
            else
                left += l->conns[i]->out != NULL;
        }
        if (!left)
            break;
        const struct timespec ms = {0, 10000000};
        nanosleep(&ms, NULL);
    }
    struct stat sb;
    if (l->ipc_path[0] && lstat(l->ipc_path, &sb) == 0 && S_ISSOCK(sb.st_mode))
        unlink(l->ipc_path);
    if (l->on_stop_stuck)
        l->on_stop_stuck(l->user, msg);
}

/* Closes the connections past their deadline: no greeting and READY within the handshake
 * timeout, or no byte for the message timeout while a message is partly read (a peer that
 * announces a large blob and stalls would pin its connection and the bytes it sent), or its
 * rate credit spent while a message is partly read (a peer that sends a byte or a heartbeat
 * just inside each timeout, or opens a new message each time, would pin it as well), or none of
 * its output taken for the message timeout (a peer that never reads would hold its replies'
 * share of the queue budget, and with a few such peers refuse every other client as busy), or
 * the rate credit of its output spent while some waits (one that reads a few bytes just inside
 * each timeout would hold its place and that share for good).
 * Returns the seconds until the next deadline (-1: none). */
static double enforce_deadlines(mdt_serve_listener *l) {
    const double now = mono_s();
    double next = -1;
    for (int i = l->nconns - 1; i >= 0; i--) {
        const peer *c = l->conns[i];
        double due = -1;
        if (!c->rd.handshaken && l->handshake_s > 0) {
            due = c->born + l->handshake_s;
        } else {
            if (c->frames > 0 && l->message_s > 0)
                due = c->last_rx + l->message_s;
            if (c->frames > 0 && l->min_rate > 0) { /* its input's rate credit spent */
                const double by = c->rx.at + c->rx.credit;
                if (due < 0 || by < due)
                    due = by;
            }
            if (c->out && l->message_s > 0 && (due < 0 || c->last_tx + l->message_s < due))
                due = c->last_tx + l->message_s;
            if (c->out && l->min_rate > 0 && (due < 0 || c->tx.at + c->tx.credit < due))
                due = c->tx.at + c->tx.credit; /* its output's rate credit spent */
        }
        if (due < 0)
            continue;
        if (due <= now)
            close_conn(l, i); /* silent, stalled, or too slow to say what it is */
        else if (next < 0 || due - now < next)
            next = due - now;
    }
    return next;
}

static void *run(void *arg) {
    mdt_serve_listener *l = arg;
    struct pollfd pf[3 + MDT_SERVE_MAX_CLIENTS];
    for (;;) {
        pthread_mutex_lock(&l->mu);
        const int quit = l->quit;
        pthread_mutex_unlock(&l->mu);
        if (quit)
            return NULL;
        take_replies(l);
        for (int i = l->nconns - 1; i >= 0; i--)
            if (out_flush(l, l->conns[i]) != 0)
                close_conn(l, i);
        const double wait_s = enforce_deadlines(l);
        int empty = 1;
        for (int i = 0; i < l->nconns; i++)
            empty &= l->conns[i]->out == NULL;
        pthread_mutex_lock(&l->mu);
        l->out_empty = empty && !l->replies;
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
        int n = 0;
        pf[n++] = (struct pollfd){l->listen_fd, POLLIN, 0};
        pf[n++] = (struct pollfd){l->wake[0], POLLIN, 0};
        const int owner = l->owner_fd >= 0 && !l->owner_gone;
        if (owner)
            pf[n++] = (struct pollfd){l->owner_fd, POLLIN, 0};
        const int first = n;
        for (int i = 0; i < l->nconns; i++) {
            const peer *c = l->conns[i];
            /* a connection whose replies are not read gets no new request in: between messages
             * it is not read until they are written (its heartbeats wait too) */
            const int take = c->frames > 0 || c->reply_bytes <= l->reply_cap;
            pf[n++] =
                (struct pollfd){c->fd, (short)((take ? POLLIN : 0) | (c->out ? POLLOUT : 0)), 0};
        }
        pthread_mutex_lock(&l->mu);
        const int busy = l->busy;
        const uint64_t busy_conn = l->busy_conn;
        char busy_op[sizeof l->busy_op], busy_id[sizeof l->busy_id];
        memcpy(busy_op, l->busy_op, sizeof busy_op), memcpy(busy_id, l->busy_id, sizeof busy_id);
        pthread_mutex_unlock(&l->mu);
        if (busy && mdt_mesh_stop_requested()) {
            if (l->stop_seen == 0)
                l->stop_seen = mono_s();
            else if (l->stop_seen > 0 && mono_s() - l->stop_seen > MDT_SERVE_STOP_GRACE_S) {
                stop_stuck(l, busy_conn, busy_op, busy_id); /* returns only without a callback */
                l->stop_seen = -1;
            }
        }
        int timeout_ms = wait_s < 0 ? -1 : (int)(wait_s * 1000) + 1;
        if (busy && (timeout_ms < 0 || timeout_ms > 200))
            timeout_ms = 200;
        if (poll(pf, (nfds_t)n, timeout_ms) < 0)
            continue;
        if (pf[1].revents) {
            char drain[64];
            while (read(l->wake[0], drain, sizeof drain) > 0)
                ;
        }
        if (owner && pf[2].revents) {
            const ssize_t r = read(l->owner_fd, l->scratch, READ_CHUNK);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                l->owner_gone = 1; /* end of input: the process that started the server is gone */
                mdt_serve_stop();
            }
        }
        /* connections by their poll slot; closing one moves the last into its place, so walk
         * from the end */
        const int nc = l->nconns;
        for (int i = nc - 1; i >= 0; i--) {
            const short ev = pf[first + i].revents;
            peer *c = l->conns[i];
            if (!ev)
                continue;
            int bad = (ev & (POLLERR | POLLNVAL)) != 0;
            if (!bad && (ev & (POLLIN | POLLHUP))) {
                const ssize_t r = recv(c->fd, l->scratch, READ_CHUNK, MSG_DONTWAIT);
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
                    bad = 1;
                else if (r > 0) {
                    c->last_io = c->last_rx = mono_s();
                    bad = feed(l, c, l->scratch, (size_t)r) != 0;
                }
            }
            if (!bad && (ev & POLLOUT))
                bad = out_flush(l, c) != 0;
            if (bad)
                close_conn(l, i);
        }
        if (pf[0].revents & POLLIN)
            accept_conns(l);
    }
}

static void wake(mdt_serve_listener *l) {
    const char b = 1;
    while (write(l->wake[1], &b, 1) < 0 && errno == EINTR)
        ;
}

/* ---- the loop's side ---- */

mdt_status mdt_serve_listen(const mdt_serve_params *p, mdt_serve_listener **out) {
    *out = NULL;
    char def[128];
    const char *ep = p->endpoint;
    if (!ep) {
        snprintf(def, sizeof def, "ipc:///tmp/meshdit-%u-%ld.sock", (unsigned)getuid(),
                 (long)getpid());
        ep = def;
    }
    mdt_serve_listener *l = mdt_calloc(sizeof *l);
    if (!l)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    l->listen_fd = l->wake[0] = l->wake[1] = l->owner_fd = -1;
    l->max_request = p->max_request_bytes > 0 ? p->max_request_bytes : (int64_t)2 << 30;
    l->max_queue = p->max_queue_bytes > 0           ? p->max_queue_bytes
                   : l->max_request > INT64_MAX / 2 ? INT64_MAX
                                                    : 2 * l->max_request;
    l->handshake_s = p->handshake_timeout;
    l->message_s = p->message_timeout;
    l->min_rate = (double)(p->min_rate > 0 ? p->min_rate : 0);
    l->rate_grace = l->message_s > 0 ? l->message_s : 30.0;
    l->reply_cap = l->max_queue / 4;
    l->on_stop_stuck = p->on_stop_stuck, l->user = p->user;
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->cv, &ca);
    pthread_condattr_destroy(&ca);
    mdt_status st = mdt_serve_endpoint_bind(ep, p->listen_any, &l->listen_fd, l->endpoint,
                                            sizeof l->endpoint, l->ipc_path, sizeof l->ipc_path);
    if (st == MDT_OK && pipe2(l->wake, O_NONBLOCK | O_CLOEXEC) != 0)
        st = MDT_FAIL(MDT_E_IO, "serve: pipe(): %s", strerror(errno));
    if (st == MDT_OK && p->owner_stdin) {
        struct stat sb;
        if (fstat(0, &sb) != 0)
            st = MDT_FAIL(MDT_E_INVALID, "--owner-stdin: standard input is not open");
        else
            l->owner_fd = 0;
        fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
    }
    if (st == MDT_OK && !(l->scratch = mdt_alloc(READ_CHUNK)))
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (st == MDT_OK) {
        sigset_t all, old; /* the thread takes no signal: the loop's handlers see them all */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        if (pthread_create(&l->thread, NULL, run, l) != 0)
            st = MDT_FAIL(MDT_E_IO, "serve: cannot start the connection thread");
        else
            l->started = 1;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    if (st != MDT_OK) {
        mdt_serve_listener_free(l);
        return st;
    }
    *out = l;
    return MDT_OK;
}

const char *mdt_serve_listener_endpoint(const mdt_serve_listener *l) { return l->endpoint; }

int mdt_serve_listener_owner_gone(const mdt_serve_listener *l) { return l && l->owner_gone; }

int mdt_serve_listener_next(mdt_serve_listener *l, int timeout_ms, mdt_serve_incoming *in) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&l->mu);
    while (!l->q && pthread_cond_timedwait(&l->cv, &l->mu, &until) == 0)
        ;
    req_item *r = l->q;
    if (r) {
        l->q = r->next;
        if (!l->q)
            l->q_tail = NULL;
    }
    pthread_mutex_unlock(&l->mu);
    if (!r)
        return 0;
    *in = r->in;
    mdt_free(r);
    return 1;
}

void mdt_serve_listener_reply(mdt_serve_listener *l, uint64_t conn, unsigned char *blob, size_t n) {
    pending_reply *r = mdt_calloc(sizeof *r);
    if (!r) {
        mdt_free(blob);
        return;
    }
    *r = (pending_reply){NULL, conn, blob, n};
    pthread_mutex_lock(&l->mu);
    l->held += (int64_t)n; /* counted until written: a client that never reads holds it */
    if (l->replies_tail)
        l->replies_tail->next = r;
    else
        l->replies = r;
    l->replies_tail = r;
    l->out_empty = 0;
    pthread_mutex_unlock(&l->mu);
    wake(l);
}

void mdt_serve_listener_busy(mdt_serve_listener *l, uint64_t conn, const char *op, const char *id,
                             int busy) {
    pthread_mutex_lock(&l->mu);
    l->busy = busy, l->busy_conn = conn;
    snprintf(l->busy_op, sizeof l->busy_op, "%s", op ? op : "");
    snprintf(l->busy_id, sizeof l->busy_id, "%s", id ? id : "");
    pthread_mutex_unlock(&l->mu);
    if (busy)
        wake(l); /* its poll watches the clock from now on */
}

void mdt_serve_listener_done(mdt_serve_listener *l, mdt_serve_incoming *in) {
    mdt_free(in->blob);
    in->blob = NULL;
    if (in->reserved)
        release(l, in->reserved);
    in->reserved = 0;
}

/* Waits up to `seconds` for every reply handed over to be written. */
static void wait_written(mdt_serve_listener *l, double seconds) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)seconds;
    until.tv_nsec += (long)((seconds - (double)(time_t)seconds) * 1e9);
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&l->mu);
    while (!l->out_empty && pthread_cond_timedwait(&l->cv, &l->mu, &until) == 0)
        ;
    pthread_mutex_unlock(&l->mu);
}

void mdt_serve_listener_fail_all(mdt_serve_listener *l, const char *msg, double seconds) {
    if (!l)
        return;
    pthread_mutex_lock(&l->mu); /* from now on a request is answered as it arrives */
    snprintf(l->ending, sizeof l->ending, "%s", msg && msg[0] ? msg : "the server is ending");
    pthread_mutex_unlock(&l->mu);
    mdt_serve_incoming in;
    while (mdt_serve_listener_next(l, 0, &in)) {
        size_t n = 0;
        unsigned char *b = refusal_blob(in.blob, in.size, msg, &n);
        if (b)
            mdt_serve_listener_reply(l, in.conn, b, n);
        mdt_serve_listener_done(l, &in);
    }
    wait_written(l, seconds);
}

void mdt_serve_listener_free(mdt_serve_listener *l) {
    if (!l)
        return;
    if (l->started) {
        wait_written(l, 1.0); /* the last replies (a close's) reach their clients */
        pthread_mutex_lock(&l->mu);
        l->quit = 1;
        pthread_mutex_unlock(&l->mu);
        wake(l);
        pthread_join(l->thread, NULL);
    }
    while (l->nconns)
        close_conn(l, l->nconns - 1);
    mdt_serve_incoming in;
    while (mdt_serve_listener_next(l, 0, &in))
        mdt_serve_listener_done(l, &in);
    for (pending_reply *r = l->replies, *next; r; r = next) {
        next = r->next;
        mdt_free(r->blob);
        mdt_free(r);
    }
    if (l->listen_fd >= 0)
        close(l->listen_fd);
    for (int i = 0; i < 2; i++)
        if (l->wake[i] >= 0)
            close(l->wake[i]);
    struct stat sb;
    if (l->ipc_path[0] && lstat(l->ipc_path, &sb) == 0 && S_ISSOCK(sb.st_mode))
        unlink(l->ipc_path);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    mdt_free(l->scratch);
    mdt_free(l);
}
