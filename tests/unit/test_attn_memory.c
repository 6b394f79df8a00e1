/*
 * test_attn_memory.c — attention memory is O(S x tile), never S x S: a narrow Flux (1 head of
 * 16, 1 + 1 blocks) runs at 16384 tokens, where one score matrix alone would be 1 GiB of floats;
 * the accounted peak (weights + activations + scratch) and the process RSS must stay far below.
 * Numerical agreement is test_kernels' job; here only finiteness and the attended row count.
 */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"
#include "models/model.h"

#include <stdlib.h>
#include <sys/resource.h>

int main(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/mdt_test_mem_XXXXXX");
    if (!mkdtemp(dir))
        return 1;
    const mdt_family *fam = mdt_family_by_name("flux");
    EXPECT_OK(mdt_model_gen(mdt_family_preset(fam, "narrow"), 1, MDT_F32, 1, dir));
    mdt_load_params lp = mdt_load_params_default();
    mdt_model *m = NULL;
    lp.checkpoint_dir = dir;
    EXPECT_OK(mdt_model_load(&lp, &m));
    if (!m)
        TEST_END();
    const int64_t S_img = 16000, S_txt = 384, S = S_img + S_txt;
    mdt_tensor_set *in, *out;
    mdt_tensor_set_create(&in);
    mdt_tensor_set_create(&out);
    mdt_inputs_params p = {.seed = 5,
                           .batch = 1,
                           .img_tokens = S_img,
                           .txt_tokens = S_txt,
                           .timestep = 1.0,
                           .guidance = 3.5};
    EXPECT_OK(mdt_model_random_inputs(m, &p, in));
    mdt_mem_reset_peak();
    mdt_counters_reset();
    EXPECT_OK(mdt_model_forward(m, in, out));
    const double score_bytes = (double)S * (double)S * 4.0;
    const double peak = (double)mdt_mem_peak();
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    const double rss = (double)ru.ru_maxrss * 1024.0;
    printf("S = %lld: one S x S score matrix %.0f MiB; accounted peak %.1f MiB; max RSS %.1f MiB\n",
           (long long)S, score_bytes / 1048576.0, peak / 1048576.0, rss / 1048576.0);
    EXPECT(peak < score_bytes / 16, "accounted peak %.0f bytes is not far below S^2 floats", peak);
    EXPECT(rss < score_bytes / 4, "max RSS %.0f bytes is not far below S^2 floats", rss);
    EXPECT(mdt_counters_get()->attn_kv_rows == 2 * S, "both blocks attended all %lld rows",
           (long long)S);
    mdt_tensor *o = mdt_tensor_set_get(out, "sample");
    int finite = o != NULL;
    for (int64_t i = 0; o && i < mdt_tensor_numel(o); i++)
        finite &= isfinite(((float *)o->data)[i]);
    EXPECT(finite, "output finite");
    mdt_tensor_set_free(in), mdt_tensor_set_free(out);
    mdt_model_free(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    TEST_END();
}
