/* test_backend.c — the front table (mdt_k): one call of each op adds exactly the FLOPs the CPU
 * kernels counted before counting moved out of them (and a device table counts nothing, so the
 * count cannot depend on the device); empty work counts nothing; bf16 weights are used only
 * when selected; mdt_k_attention gives its arena scratch back. */
#include "backend/backend.h"
#include "harness.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { M = 3, C = 8, K = 5, N = 4, S = 2, H = 3, D = 4, SK = 5 };

static double other(void) { return mdt_counters_get()->flops[MDT_FLOP_OTHER]; }

/* Calls every op once on small shapes through table t. */
static void call_all(const mdt_kernel_ops *t, float *buf, float *out, const int64_t *idx) {
    t->linear(buf, K, buf, NULL, NULL, out, N, M, K, N);
    t->layernorm_modulate(buf, out, M, C, 1e-6f, NULL, NULL);
    t->heads_prepare(buf, H * D, S, H, D, NULL, 0.0f, NULL, NULL, 0, MDT_ROPE_INTERLEAVED, out, S,
                     0);
    t->rmsnorm(buf, NULL, out, M, C, 1e-6f);
    t->modulate_rows(out, M, C, buf, 2 * C, idx, 0, C);
    t->gate_residual_rows(out, buf, C, buf, 3 * C, idx, 2 * C, M, C);
    t->gate_residual(out, buf, C, buf, M, C);
    t->swiglu(buf, out, M, 4);
    t->gelu_rows(out, C, M, C);
    t->silu(out, C);
    t->copy2d(out, C, buf, C, M, C);
    t->copy_rows(out, C, NULL, buf, C, NULL, M, C);
    t->fill(out, C, 1.0f);
    t->add(out, buf, C);
    t->add_bias(out, C, buf, M, C);
}

int main(void) {
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 0));
    float *buf = calloc(4096, sizeof(float)), *out = calloc(4096, sizeof(float));
    const int64_t idx[M] = {0, 0, 0};
    for (int i = 0; i < 4096; i++)
        buf[i] = 0.01f * (float)(i % 97);

    /* the old per-kernel counts: linear 2MNK; layernorm 8MC, heads 8SHD, rmsnorm 4MC,
     * modulate 3MC, gate residuals 2MC each, swiglu 6Mn, gelu 10 per float, silu 5 per float */
    const double want_other = 8.0 * M * C + 8.0 * S * H * D + 4.0 * M * C + 3.0 * M * C +
                              2.0 * M * C + 2.0 * M * C + 6.0 * M * 4 + 10.0 * M * C + 5.0 * C;
    mdt_counters_reset();
    call_all(mdt_k(), buf, out, idx);
    EXPECT(mdt_counters_get()->flops[MDT_FLOP_LINEAR] == 2.0 * M * N * K, "linear FLOPs %g",
           mdt_counters_get()->flops[MDT_FLOP_LINEAR]);
    EXPECT(other() == want_other, "other FLOPs %g, want %g", other(), want_other);

    /* the device table itself counts nothing: the count is the front's, whatever the device */
    mdt_counters_reset();
    call_all(mdt_backend_kernels(), buf, out, idx);
    EXPECT(other() == 0.0 && mdt_counters_get()->flops[MDT_FLOP_LINEAR] == 0.0,
           "device table counted %g", other());
    /* the same counts on every kernel set this CPU runs */
    const char *isas[] = {"x86-64", "avx2", "avx512"};
    for (int i = 0; i < 3; i++) {
        if (!mdt_cpu_isa_available(isas[i]))
            continue;
        EXPECT_OK(mdt_cpu_isa_select(isas[i]));
        mdt_counters_reset();
        call_all(mdt_k(), buf, out, idx);
        EXPECT(other() == want_other, "%s: other FLOPs %g", isas[i], other());
    }
    EXPECT_OK(mdt_cpu_isa_select("auto"));

    /* empty work: nothing runs, nothing is counted */
    mdt_counters_reset();
    mdt_k()->silu(out, 0);
    mdt_k()->linear(buf, K, buf, NULL, NULL, out, N, 0, K, N);
    mdt_k()->layernorm_modulate(buf, out, 0, C, 1e-6f, NULL, NULL);
    EXPECT(other() == 0.0 && mdt_counters_get()->flops[MDT_FLOP_LINEAR] == 0.0,
           "empty ops counted");

    /* attention: 4 H Sq kv D with kv = min(sk_valid, Sk), one call; scratch given back */
    mdt_arena ar;
    mdt_arena_init(&ar);
    mdt_counters_reset();
    float *q = buf, *kk = buf + 512, *v = buf + 1024, lse[H * M];
    const mdt_arena_mark mk = mdt_arena_mark_get(&ar);
    mdt_attn_args a = {.q = q,
                       .k = kk,
                       .v = v,
                       .out = out,
                       .ld_out = H * D,
                       .lse = lse,
                       .H = H,
                       .Sq = M,
                       .Sk = SK,
                       .kv = 4,
                       .D = D,
                       .scale = 0.5f};
    EXPECT_OK(mdt_k_attention(&ar, &a));
    EXPECT(mdt_counters_get()->flops[MDT_FLOP_ATTN] == 4.0 * H * M * 4 * D &&
               mdt_counters_get()->attn_calls == 1,
           "attention FLOPs %g, calls %lld", mdt_counters_get()->flops[MDT_FLOP_ATTN],
           (long long)mdt_counters_get()->attn_calls);
    const mdt_arena_mark mk2 = mdt_arena_mark_get(&ar);
    EXPECT(mk.in_use == mk2.in_use, "attention scratch given back to the arena");
    a.kv = 9;
    EXPECT_OK(mdt_k_attention(&ar, &a));
    EXPECT(mdt_counters_get()->flops[MDT_FLOP_ATTN] == 4.0 * H * M * 4 * D + 4.0 * H * M * SK * D,
           "valid keys beyond Sk count as Sk: %g", mdt_counters_get()->flops[MDT_FLOP_ATTN]);
    mdt_arena_release(&ar);

    /* bf16 weights are used only when selected: fp32 backend, a bogus wh is ignored */
    float y1[M * N], y2[M * N];
    const uint16_t bogus[N * K] = {0};
    mdt_k()->linear(buf, K, buf, NULL, NULL, y1, N, M, K, N);
    mdt_k()->linear(buf, K, buf, bogus, NULL, y2, N, M, K, N);
    int same = 1;
    for (int i = 0; i < M * N; i++)
        same &= y1[i] == y2[i];
    EXPECT(same, "fp32 backend ignores bf16 weights");
    EXPECT_OK(mdt_backend_check());
    free(buf), free(out);
    TEST_END();
}
