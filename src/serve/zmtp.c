/*
 * zmtp.c — see zmtp.h. The byte layouts (ZMTP 3.1):
 *
 *   greeting  FF, 8 bytes of padding, 7F, version 3.x, mechanism "NULL" padded to 20 bytes,
 *             as-server (1 byte), 31 bytes of filler: 64 bytes
 *   frame     flags (bit 0 MORE, bit 1 LONG size, bit 2 COMMAND; the others 0), size (1 byte, or
 *             8 bytes big-endian when LONG), body
 *   command   a frame with COMMAND set: name length, name, data. READY's data is properties:
 *             name length (1 byte), name, value length (4 bytes big-endian), value. PING's data
 *             is a 2-byte TTL and up to 16 bytes of context, which PONG sends back.
 *
 * After both greetings each side of a NULL connection sends READY; then message frames and
 * commands interleave. The reader collects the small pieces (greeting, frame headers, command
 * bodies) into its own buffer and hands message bodies on in place.
 */
#include "serve/zmtp.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

enum {
    P_GREETING,
    P_HEADER,   /* a frame's flags and size */
    P_COMMAND,  /* a command frame's body */
    P_BODY,     /* a message frame's body */
    P_FRAME_END /* a message frame whose body has arrived: report its end */
};
enum { F_MORE = 1, F_LONG = 2, F_COMMAND = 4 };

static size_t fail(mdt_zmtp_reader *r, mdt_zmtp_event *ev, size_t used, const char *why) {
    if (!r->error[0])
        snprintf(r->error, sizeof r->error, "%s", why);
    r->want = (size_t)-1; /* every later call fails too */
    ev->kind = MDT_ZMTP_EV_ERROR;
    return used;
}

void mdt_zmtp_reader_init(mdt_zmtp_reader *r) {
    memset(r, 0, sizeof *r);
    r->phase = P_GREETING;
    r->want = MDT_ZMTP_GREETING_BYTES;
}

/* Collects bytes into buf until `want` are there; returns the bytes taken. */
static size_t collect(mdt_zmtp_reader *r, const unsigned char *p, size_t n) {
    size_t k = r->want - r->have < n ? r->want - r->have : n;
    memcpy(r->buf + r->have, p, k);
    r->have += k;
    return k;
}

static uint64_t be64(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | b[i];
    return v;
}

/* READY's properties: finds Socket-Type (names are case-insensitive). 0 when malformed. */
static int parse_ready(mdt_zmtp_reader *r, const unsigned char *d, size_t n) {
    size_t i = 0;
    while (i < n) {
        const size_t nl = d[i++];
        if (nl == 0 || i + nl + 4 > n)
            return 0;
        const unsigned char *name = d + i;
        i += nl;
        const uint64_t vl = (uint64_t)d[i] << 24 | (uint64_t)d[i + 1] << 16 |
                            (uint64_t)d[i + 2] << 8 | (uint64_t)d[i + 3];
        i += 4;
        if (vl > n - i)
            return 0;
        if (nl == 11 && strncasecmp((const char *)name, "Socket-Type", 11) == 0) {
            const size_t k = vl < sizeof r->peer_type - 1 ? (size_t)vl : sizeof r->peer_type - 1;
            memcpy(r->peer_type, d + i, k);
            r->peer_type[k] = 0;
        }
        i += (size_t)vl;
    }
    return 1;
}

/* A complete command body in buf[0..have). */
static size_t command(mdt_zmtp_reader *r, mdt_zmtp_event *ev, size_t used) {
    const unsigned char *b = r->buf;
    const size_t n = r->have;
    if (n < 1 || (size_t)b[0] + 1 > n)
        return fail(r, ev, used, "a malformed command frame");
    const size_t nl = b[0];
    const char *name = (const char *)b + 1;
    const unsigned char *d = b + 1 + nl;
    const size_t dn = n - 1 - nl;
    r->phase = P_HEADER, r->have = 0, r->want = 1;
    if (!r->handshaken) {
        if (nl == 5 && memcmp(name, "ERROR", 5) == 0)
            return fail(r, ev, used, "the peer sent an ERROR command during the handshake");
        if (nl != 5 || memcmp(name, "READY", 5) != 0)
            return fail(r, ev, used, "the peer's first command is not READY");
        if (!parse_ready(r, d, dn) || !r->peer_type[0])
            return fail(r, ev, used, "the peer's READY has no valid Socket-Type");
        r->handshaken = 1;
        ev->kind = MDT_ZMTP_EV_READY;
        return used;
    }
    if (nl == 4 && memcmp(name, "PING", 4) == 0) {
        if (dn < 2)
            return fail(r, ev, used, "a PING without its TTL");
        r->ping_ctx_len = dn - 2 > sizeof r->ping_ctx ? sizeof r->ping_ctx : dn - 2;
        memcpy(r->ping_ctx, d + 2, r->ping_ctx_len);
        ev->kind = MDT_ZMTP_EV_PING;
        return used;
    }
    if (nl == 5 && memcmp(name, "READY", 5) == 0)
        return fail(r, ev, used, "a second READY");
    return used; /* PONG, or a command of a later revision: nothing to do */
}

size_t mdt_zmtp_step(mdt_zmtp_reader *r, const unsigned char *p, size_t n, mdt_zmtp_event *ev) {
    memset(ev, 0, sizeof *ev);
    size_t used = 0;
    if (r->want == (size_t)-1) { /* failed before */
        ev->kind = MDT_ZMTP_EV_ERROR;
        return 0;
    }
    switch (r->phase) {
    case P_GREETING: {
        used = collect(r, p, n);
        if (r->have >= 1 && r->buf[0] != 0xff)
            return fail(r, ev, used, "not a ZMTP peer (the greeting does not start with 0xFF)");
        if (r->have < r->want)
            return used;
        const unsigned char *g = r->buf;
        if (!(g[9] & 1))
            return fail(r, ev, used, "not a ZMTP peer (bad greeting signature)");
        if (g[10] < 3)
            return fail(r, ev, used, "the peer speaks ZMTP 1 or 2 (libzmq < 4): ZMTP 3 is needed");
        char mech[21];
        memcpy(mech, g + 12, 20);
        mech[20] = 0;
        if (strcmp(mech, "NULL") != 0) {
            char why[96];
            snprintf(why, sizeof why, "the peer asks for security mechanism '%.20s' (only NULL)",
                     mech);
            for (char *c = why; *c; c++)
                if ((unsigned char)*c < 0x20 || (unsigned char)*c > 0x7e)
                    *c = '?';
            return fail(r, ev, used, why);
        }
        r->phase = P_HEADER, r->have = 0, r->want = 1;
        return used;
    }
    case P_HEADER: {
        used = collect(r, p, n);
        if (r->have < r->want)
            return used;
        const unsigned f = r->buf[0];
        if (f & ~(unsigned)(F_MORE | F_LONG | F_COMMAND))
            return fail(r, ev, used, "a frame with reserved flag bits set");
        const size_t need = 1 + (f & F_LONG ? 8 : 1);
        if (r->want < need) {
            r->want = need;
            return used;
        }
        const uint64_t size = f & F_LONG ? be64(r->buf + 1) : r->buf[1];
        if (size >> 62)
            return fail(r, ev, used, "a frame size past 2^62 bytes");
        r->flags = f, r->left = size, r->have = 0;
        if (f & F_COMMAND) {
            if (f & F_MORE)
                return fail(r, ev, used, "a command frame with MORE set");
            if (size > MDT_ZMTP_CMD_MAX)
                return fail(r, ev, used, "a command frame over 4096 bytes");
            r->phase = P_COMMAND, r->want = (size_t)size;
            if (size == 0)
                return fail(r, ev, used, "an empty command frame");
            return used;
        }
        if (!r->handshaken)
            return fail(r, ev, used, "a message frame before the READY command");
        r->phase = size ? P_BODY : P_FRAME_END;
        ev->kind = MDT_ZMTP_EV_FRAME_START;
        ev->more = (f & F_MORE) != 0, ev->size = size;
        return used;
    }
    case P_COMMAND:
        used = collect(r, p, n);
        if (r->have < r->want)
            return used;
        return command(r, ev, used);
    case P_BODY: {
        if (n == 0)
            return 0;
        const size_t k = r->left < n ? (size_t)r->left : n;
        r->left -= k;
        ev->kind = MDT_ZMTP_EV_BODY, ev->data = p, ev->len = k;
        if (r->left == 0)
            r->phase = P_FRAME_END;
        return k;
    }
    case P_FRAME_END:
        ev->kind = MDT_ZMTP_EV_FRAME_END, ev->more = (r->flags & F_MORE) != 0;
        r->phase = P_HEADER, r->have = 0, r->want = 1;
        return 0;
    default: break;
    }
    return fail(r, ev, 0, "reader in an unknown state");
}

size_t mdt_zmtp_greeting(unsigned char *out) {
    memset(out, 0, MDT_ZMTP_GREETING_BYTES);
    out[0] = 0xff, out[9] = 0x7f, out[10] = 3, out[11] = 1;
    out[12] = 'N', out[13] = 'U', out[14] = 'L', out[15] = 'L';
    return MDT_ZMTP_GREETING_BYTES;
}

size_t mdt_zmtp_ready(unsigned char *out, size_t cap) {
    static const unsigned char body[] = {5,   'R', 'E', 'A', 'D', 'Y', 11,  'S', 'o', 'c',
                                         'k', 'e', 't', '-', 'T', 'y', 'p', 'e', 0,   0,
                                         0,   6,   'R', 'O', 'U', 'T', 'E', 'R'};
    if (cap < 2 + sizeof body)
        return 0;
    out[0] = F_COMMAND, out[1] = (unsigned char)sizeof body;
    memcpy(out + 2, body, sizeof body);
    return 2 + sizeof body;
}

size_t mdt_zmtp_pong(const unsigned char *ctx, size_t ctx_len, unsigned char *out, size_t cap) {
    if (ctx_len > 16 || cap < 7 + ctx_len)
        return 0;
    out[0] = F_COMMAND, out[1] = (unsigned char)(5 + ctx_len), out[2] = 4;
    out[3] = 'P', out[4] = 'O', out[5] = 'N', out[6] = 'G';
    memcpy(out + 7, ctx, ctx_len);
    return 7 + ctx_len;
}

size_t mdt_zmtp_frame_header(uint64_t size, int more, unsigned char *out) {
    if (size < 256) {
        out[0] = (unsigned char)(more ? F_MORE : 0), out[1] = (unsigned char)size;
        return 2;
    }
    out[0] = (unsigned char)(F_LONG | (more ? F_MORE : 0));
    for (int i = 0; i < 8; i++)
        out[1 + i] = (unsigned char)(size >> (56 - 8 * i));
    return 9;
}
