/* test_plan.c — shard maths, looping over every coordinate in one process: the pieces of all
 * ranks tile the tensor exactly once, packed blocks are sharded block by block, and bad degrees
 * are refused with the numbers. */
#include "harness.h"
#include "parallel/plan.h"

static mdt_weight_spec spec(const char *name, int64_t d0, int64_t d1, mdt_tp_style st) {
    mdt_weight_spec w;
    memset(&w, 0, sizeof w);
    snprintf(w.name, sizeof w.name, "%s", name);
    w.ndim = d1 ? 2 : 1;
    w.shape[0] = d0, w.shape[1] = d1;
    w.style = st;
    return w;
}

/* every index of the shard dim is owned by exactly one coordinate */
static int tiles_exactly(const mdt_weight_spec *w, int T) {
    int dim = mdt_tp_shard_dim(w->style);
    int64_t len = w->shape[dim], hits[4096] = {0};
    for (int k = 0; k < T; k++) {
        int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
        int n;
        if (mdt_shard_ranges(w, T, k, st, ln, &n) != MDT_OK)
            return 0;
        for (int b = 0; b < n; b++)
            for (int64_t i = st[b]; i < st[b] + ln[b]; i++)
                hits[i]++;
    }
    for (int64_t i = 0; i < len; i++)
        if (hits[i] != 1)
            return 0;
    return 1;
}

int main(void) {
    int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS], loc[2];
    int n;
    /* Flux single-block proj_out: input [attn 32 | mlp 128], tp=2 (parallel-semantics §8.1) */
    mdt_weight_spec po =
        spec("single_transformer_blocks.0.proj_out.weight", 32, 160, MDT_TP_PACKED_ROWWISE);
    po.nblocks = 2, po.blocks[0] = 32, po.blocks[1] = 128;
    EXPECT_OK(mdt_shard_ranges(&po, 2, 1, st, ln, &n));
    EXPECT(n == 2 && st[0] == 16 && ln[0] == 16 && st[1] == 96 && ln[1] == 64,
           "packed rowwise k=1: [%lld+%lld, %lld+%lld]", (long long)st[0], (long long)ln[0],
           (long long)st[1], (long long)ln[1]);
    EXPECT_OK(mdt_shard_local_shape(&po, 2, loc));
    EXPECT(loc[0] == 32 && loc[1] == 80, "packed local shape");
    for (int T = 1; T <= 16; T *= 2)
        EXPECT(tiles_exactly(&po, T), "packed tiles at T=%d", T);

    mdt_weight_spec col = spec("ff.net.0.proj.weight", 128, 32, MDT_TP_COLWISE);
    EXPECT_OK(mdt_shard_ranges(&col, 4, 3, st, ln, &n));
    EXPECT(n == 1 && st[0] == 96 && ln[0] == 32, "colwise k=3 of 4");
    EXPECT_OK(mdt_shard_local_shape(&col, 4, loc));
    EXPECT(loc[0] == 32 && loc[1] == 32, "colwise local shape");
    mdt_weight_spec row = spec("attn.to_out.0.weight", 32, 64, MDT_TP_ROWWISE);
    EXPECT_OK(mdt_shard_local_shape(&row, 8, loc));
    EXPECT(loc[0] == 32 && loc[1] == 8, "rowwise local shape");
    mdt_weight_spec ada = spec("norm1.linear.weight", 192, 32, MDT_TP_REPLICATED_INPUT_ROWWISE);
    EXPECT_OK(mdt_shard_local_shape(&ada, 4, loc));
    EXPECT(loc[0] == 192 && loc[1] == 8, "replicated-input rowwise shards the input features");
    mdt_weight_spec rep = spec("norm_q.weight", 16, 0, MDT_TP_REPLICATED);
    EXPECT_OK(mdt_shard_ranges(&rep, 8, 5, st, ln, &n));
    EXPECT(n == 1 && st[0] == 0 && ln[0] == 16, "replicated is whole on every rank");
    for (int T = 1; T <= 32; T *= 2)
        EXPECT(tiles_exactly(&col, T) && tiles_exactly(&row, T), "tiles at T=%d", T);

    EXPECT_ERR(mdt_shard_ranges(&col, 3, 0, st, ln, &n), MDT_E_INVALID, "tp=3 does not divide",
               "ff.net.0.proj.weight", "128");
    EXPECT_ERR(mdt_shard_ranges(&col, 2, 2, st, ln, &n), MDT_E_INVALID, "outside degree 2");
    po.blocks[1] = 100;
    EXPECT_ERR(mdt_shard_ranges(&po, 2, 0, st, ln, &n), MDT_E_INVALID, "blocks sum");

    /* sequence chunks: the first S mod P get one extra row; contiguous; cover S */
    int ok = 1;
    for (int64_t S = 1; S <= 70; S++)
        for (int P = 1; P <= 9; P++) {
            int64_t pos = 0;
            for (int c = 0; c < P; c++) {
                int64_t s0, l;
                mdt_split_range(S, P, c, &s0, &l);
                ok &= s0 == pos && l == S / P + (c < S % P);
                pos += l;
            }
            ok &= pos == S;
        }
    EXPECT(ok, "split ranges tile every S with first S mod P chunks larger");
    int64_t s0, l;
    mdt_split_range(37, 4, 1, &s0, &l);
    EXPECT(s0 == 10 && l == 9, "37 over 4, chunk 1 = [10, 19)");
    TEST_END();
}
