/*
 * test_env.c — the command's test mode: reads the MESHDIT_TEST_* switches once at start-up and
 * installs the library's test hooks (core/testhooks.h); the library never reads them itself.
 *   MESHDIT_TEST_SHARD_INDEX=world    a rank's TP shard index is its world rank (upstream bug)
 *   MESHDIT_TEST_SKIP_CP_SPLIT=1      every rank computes the whole sequence (upstream bug)
 *   MESHDIT_TEST_CFG_SAME_BRANCH=1    cfg group 1 computes the conditional branch too
 *   MESHDIT_TEST_FAIL=PHASE:RANK[:kill|:stop]  world rank RANK fails at PHASE ("load":
 *                                     mid-load, "step": inside a forward, "stage": between two
 *                                     blocks), or dies by SIGKILL, or stops itself (SIGSTOP: a
 *                                     rank that hangs), raised here
 *   MESHDIT_TEST_NAN=STAGE:ELEM       the output of block STAGE ("transformer_blocks.0") holds a
 *                                     NaN at element ELEM of each rank's rows
 */
#define _POSIX_C_SOURCE 200809L
#include "cli/cli.h"
#include "core/testhooks.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

static char g_fail[256]; /* MESHDIT_TEST_FAIL as given */
static char g_fail_phase[16];
static int g_fail_rank = -1, g_fail_kill, g_fail_stop;
static char g_nan_stage[64]; /* MESHDIT_TEST_NAN's block */

static mdt_status at_point(const char *phase, int world_rank) {
    if (strcmp(g_fail_phase, phase) != 0 || world_rank != g_fail_rank)
        return MDT_OK;
    if (g_fail_kill)
        raise(SIGKILL); /* a rank that dies */
    if (g_fail_stop)
        raise(SIGSTOP); /* a rank that hangs: only SIGKILL (the launcher's) ends it */
    return mdt_error_set(MDT_E_IO, "injected failure during %s (MESHDIT_TEST_FAIL=%s)", phase,
                         g_fail);
}

void cli_test_env_install(void) {
    const char *shard = getenv("MESHDIT_TEST_SHARD_INDEX");
    const char *skip = getenv("MESHDIT_TEST_SKIP_CP_SPLIT");
    const char *same = getenv("MESHDIT_TEST_CFG_SAME_BRANCH");
    const char *fail = getenv("MESHDIT_TEST_FAIL");
    mdt_test_hooks h = {0};
    h.shard_index_world = shard && strcmp(shard, "world") == 0;
    h.skip_cp_split = skip && strcmp(skip, "1") == 0;
    h.cfg_same_branch = same && strcmp(same, "1") == 0;
    int n = 0;
    if (fail && strlen(fail) < sizeof g_fail &&
        sscanf(fail, "%15[a-z]:%d%n", g_fail_phase, &g_fail_rank, &n) == 2) {
        snprintf(g_fail, sizeof g_fail, "%s", fail);
        g_fail_kill = strcmp(fail + n, ":kill") == 0;
        g_fail_stop = strcmp(fail + n, ":stop") == 0;
        h.at_point = at_point;
    }
    const char *nan = getenv("MESHDIT_TEST_NAN");
    long long elem = -1;
    if (nan && sscanf(nan, "%63[a-z_.0-9]:%lld", g_nan_stage, &elem) == 2 && elem >= 0)
        h.nan_stage = g_nan_stage, h.nan_elem = elem;
    if (h.shard_index_world || h.skip_cp_split || h.cfg_same_branch || h.at_point || h.nan_stage)
        mdt_test_hooks_set(&h);
}
