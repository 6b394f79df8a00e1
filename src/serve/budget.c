/*
 * budget.c — the memory a request's forward may take on one rank (docs/serve.md, Limits): the
 * same check `meshdit run` makes before its load (this rank's weights plus the activations of
 * these inputs), against --max-memory when given, else against what the process may use. The
 * default is measured once, when the server starts: MemAvailable and the cgroups' headroom
 * (core/sysmem.h) then exclude the weights just loaded, so the share of each of the node's
 * ranks is that headroom divided among them plus this rank's own weights — what run compares
 * with before its load. MESHDIT_MEM_AVAILABLE (through p->mem_available) replaces the figure as
 * it does for run (the figure before the load). No MPI: the caller agrees on the verdict.
 */
#include "serve/serve.h"

#include "core/sysmem.h"
#include "models/model.h"
#include "plan/memory.h"

#include <stdio.h>
#include <string.h>

mdt_status mdt_serve_budget_init(mdt_serve_budget *b, const mdt_model *m,
                                 const mdt_serve_params *p) {
    char src[64], b1[32], b2[32];
    memset(b, 0, sizeof *b);
    if (p->max_memory > 0) {
        b->limit = p->max_memory;
        return MDT_OK;
    }
    const int nlocal = m->mesh && m->mesh->node_size > 0 ? m->mesh->node_size : 1;
    int64_t avail, share;
    if (p->mem_available && *p->mem_available) {
        if ((avail = mdt_size_parse(p->mem_available)) <= 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "MESHDIT_MEM_AVAILABLE='%s' is not a size like 512M, 8G or 1048576",
                            p->mem_available);
        snprintf(src, sizeof src, "MESHDIT_MEM_AVAILABLE");
        share = avail / nlocal;
    } else if ((avail = mdt_mem_available("", src, sizeof src)) < 0) {
        return MDT_OK; /* nothing to go by: no check, as in run */
    } else {
        share = avail / nlocal + mdt_model_weight_bytes(m);
    }
    b->limit = share;
    b->is_default = 1;
    snprintf(b->what, sizeof b->what,
             "the %s this rank may use (%s: %s for the %d rank%s on this node at the server's "
             "start%s; --max-memory SIZE overrides this check)",
             mdt_fmt_size(share, b1, sizeof b1), src, mdt_fmt_size(avail, b2, sizeof b2), nlocal,
             nlocal > 1 ? "s" : "",
             p->mem_available && *p->mem_available ? "" : ", besides its weights");
    return MDT_OK;
}

mdt_status mdt_serve_budget_check(const mdt_serve_budget *b, const mdt_model *m,
                                  const mdt_tensor_set *inputs, int device_activations) {
    if (b->limit <= 0)
        return MDT_OK;
    const mdt_status st = mdt_check_forward_memory(m, inputs, b->limit, device_activations);
    if (st == MDT_OK || !b->is_default)
        return st;
    /* the estimate's message names "the --max-memory limit of X": say what the limit is */
    char flag[96], sz[32], msg[1024];
    snprintf(flag, sizeof flag, "the --max-memory limit of %s",
             mdt_fmt_size(b->limit, sz, sizeof sz));
    const char *last = mdt_last_error(), *at = strstr(last, flag);
    if (!at)
        return st;
    snprintf(msg, sizeof msg, "%.*s%s%s", (int)(at - last), last, b->what, at + strlen(flag));
    return MDT_FAIL(st, "%s", msg);
}
