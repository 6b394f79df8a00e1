/* fuzz_request.c — libFuzzer target: the input is one request blob of `meshdit serve`
 * (docs/serve.md), parsed from memory by the same validating safetensors reader as files and
 * checked as a request; a request that parses is run through the session store (its merge, limits
 * and commit, under small limits) and answered; its first MDT_SERVE_PEEK_BYTES are read for the
 * op and id a refusal names, and an id so read from a request that parses must be the one its
 * reply echoes. Every input must either give a request or fail with a
 * status; never crash, leak or read out of bounds. */
#include "serve/serve.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mdt_serve_request r;
    mdt_serve_sessions ss;
    unsigned char *reply = NULL;
    size_t n = 0;
    if (mdt_serve_sessions_init(&ss, 2, 1 << 16, 1000) != MDT_OK)
        return 0;
    const int parsed = mdt_serve_request_parse(data, size, &r) == MDT_OK;
    if (parsed) {
        if (r.new_session) /* the token serve.c would draw */
            snprintf(r.session, sizeof r.session, "%032x", 7);
        /* twice: the second finds what the first kept */
        for (int i = 0; i < 2; i++)
            if (mdt_serve_sessions_prepare(&ss, &r) == MDT_OK)
                (void)mdt_serve_sessions_commit(&ss, &r);
        const char *meta[] = {"op", r.op_name, "id", r.id, NULL};
        if (mdt_serve_reply_ok(meta, r.tensors, &reply, &n) == MDT_OK)
            mdt_free(reply);
    } else if (mdt_serve_reply_error(r.op_name, r.id, mdt_last_error(), MDT_E_INVALID, &reply,
                                     &n) == MDT_OK) {
        mdt_free(reply);
    }
    char op[16], id[MDT_SERVE_NAME_MAX + 1], wanted[MDT_SERVE_NAME_MAX + 1];
    snprintf(wanted, sizeof wanted, "%s", r.id);
    mdt_serve_request_free(&r);
    mdt_serve_sessions_free(&ss);
    mdt_serve_request_peek(data, size < MDT_SERVE_PEEK_BYTES ? size : MDT_SERVE_PEEK_BYTES, op, id);
    if (parsed && id[0] && strcmp(id, wanted) != 0)
        __builtin_trap(); /* a refusal would name another id than the reply */
    return 0;
}
