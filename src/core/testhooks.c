/*
 * testhooks.c — see testhooks.h.
 */
#include "core/testhooks.h"

static mdt_test_hooks g_hooks;

void mdt_test_hooks_set(const mdt_test_hooks *h) {
    static const mdt_test_hooks none;
    g_hooks = h ? *h : none;
}

const mdt_test_hooks *mdt_test_hooks_get(void) { return &g_hooks; }

mdt_status mdt_test_point(const char *phase, int world_rank) {
    return g_hooks.at_point ? g_hooks.at_point(phase, world_rank) : MDT_OK;
}
