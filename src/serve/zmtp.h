/*
 * zmtp.h — the server's side of ZeroMQ's wire protocol (ZMTP 3.1, rfc.zeromq.org/spec/37, NULL
 * security) for one connection, as a reader fed bytes and writers of the few things the server
 * sends. The server speaks ZMTP itself instead of through libzmq because libzmq buffers a whole
 * multipart message before the application sees its first frame (ZMQ_MAXMSGSIZE bounds a frame,
 * nothing bounds a message: 128 frames of 4 MiB cost rank 0 512 MiB): reading the frames as
 * they arrive is what lets the server refuse a message without holding it. Clients are any
 * ZeroMQ DEALER or REQ socket (libzmq >= 4, pyzmq). No socket, no thread, no allocation here:
 * tests/unit/test_serve.c and tests/fuzz/fuzz_zmtp.c feed it bytes.
 */
#ifndef MDT_SERVE_ZMTP_H
#define MDT_SERVE_ZMTP_H

#include <stddef.h>
#include <stdint.h>

#define MDT_ZMTP_GREETING_BYTES 64
#define MDT_ZMTP_CMD_MAX 4096 /* a command frame's body (READY, PING); a longer one is refused */

typedef enum mdt_zmtp_event_kind {
    MDT_ZMTP_EV_NONE = 0,    /* more bytes are needed */
    MDT_ZMTP_EV_READY,       /* the peer's greeting and READY arrived: send ours (peer_type set) */
    MDT_ZMTP_EV_PING,        /* a heartbeat: answer mdt_zmtp_pong with ping_ctx */
    MDT_ZMTP_EV_FRAME_START, /* a message frame begins: `more`, `size` */
    MDT_ZMTP_EV_BODY,        /* `len` bytes of the frame's body at `data` (into the caller's
                                buffer: consume them before the next call) */
    MDT_ZMTP_EV_FRAME_END,   /* the frame is complete (`more`: another frame of the message
                                follows) */
    MDT_ZMTP_EV_ERROR,       /* the peer broke the protocol: close the connection (`error`) */
} mdt_zmtp_event_kind;

typedef struct mdt_zmtp_event {
    mdt_zmtp_event_kind kind;
    int more;
    uint64_t size;
    const unsigned char *data;
    size_t len;
} mdt_zmtp_event;

typedef struct mdt_zmtp_reader {
    int phase;         /* greeting, frame header, command body, message body, frame end */
    int handshaken;    /* the peer's READY arrived: message frames may follow */
    size_t have, want; /* bytes of buf collected / needed for the current small piece */
    unsigned char buf[MDT_ZMTP_CMD_MAX];
    unsigned flags;     /* of the current frame */
    uint64_t left;      /* body bytes of the current frame still to come */
    char peer_type[16]; /* the peer's Socket-Type ("DEALER", "REQ") */
    unsigned char ping_ctx[16];
    size_t ping_ctx_len;
    char error[160];
} mdt_zmtp_reader;

void mdt_zmtp_reader_init(mdt_zmtp_reader *r);
/* Consumes at most `n` bytes at `p` (returns how many) and reports at most one event in *ev. The
 * caller calls it again (also with n = 0: a frame's end is reported after its last byte) until it
 * consumes nothing and reports MDT_ZMTP_EV_NONE; after MDT_ZMTP_EV_ERROR every call fails. */
size_t mdt_zmtp_step(mdt_zmtp_reader *r, const unsigned char *p, size_t n, mdt_zmtp_event *ev);

/* What the server sends: its greeting (version 3.1, NULL, as-server 0), its READY (Socket-Type
 * ROUTER), a PONG answering a PING's context, and the header of a message frame (`more` set for
 * all frames but the last). Each returns the bytes written into `out` (`cap` large enough: 64 for
 * the greeting, 32 for READY and PONG headers, 9 for a frame header). */
size_t mdt_zmtp_greeting(unsigned char *out);
size_t mdt_zmtp_ready(unsigned char *out, size_t cap);
size_t mdt_zmtp_pong(const unsigned char *ctx, size_t ctx_len, unsigned char *out, size_t cap);
size_t mdt_zmtp_frame_header(uint64_t size, int more, unsigned char *out);

#endif /* MDT_SERVE_ZMTP_H */
