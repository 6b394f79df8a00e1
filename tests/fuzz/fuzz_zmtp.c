/* fuzz_zmtp.c — libFuzzer target: the input's first byte picks a piece size (1..256), the rest is
 * what a peer sends the server (greeting, commands, frames), fed to the ZMTP reader in pieces of
 * that size. Every input must give events or a protocol error; never crash, loop, or report body
 * bytes beyond a frame's announced size. */
#include "serve/zmtp.h"

#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    const size_t piece = (size_t)data[0] + 1;
    data++, size--;
    mdt_zmtp_reader r;
    mdt_zmtp_reader_init(&r);
    uint64_t announced = 0, body = 0;
    for (size_t pos = 0; pos <= size;) {
        const size_t n = size - pos < piece ? size - pos : piece;
        const uint8_t *p = data + pos;
        size_t left = n;
        for (int steps = 0;; steps++) {
            if (steps > 1000000)
                abort(); /* the reader must always make progress */
            mdt_zmtp_event ev;
            const size_t used = mdt_zmtp_step(&r, p, left, &ev);
            if (used > left)
                abort();
            p += used, left -= used;
            if (ev.kind == MDT_ZMTP_EV_FRAME_START)
                announced = ev.size, body = 0;
            if (ev.kind == MDT_ZMTP_EV_BODY && (body += ev.len) > announced)
                abort();
            if (ev.kind == MDT_ZMTP_EV_ERROR)
                return 0;
            if (ev.kind == MDT_ZMTP_EV_NONE && used == 0)
                break;
        }
        if (pos == size)
            break;
        pos += n;
    }
    return 0;
}
