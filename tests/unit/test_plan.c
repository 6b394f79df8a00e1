/* test_plan.c — shard maths, looping over every coordinate in one process: the pieces of all
 * ranks tile the tensor exactly once, packed blocks are sharded block by block, uneven shards
 * (an FFN's hidden features tp does not divide) give the first n mod T coordinates one more in
 * order, and bad degrees are refused with the numbers. */
#include "core/testhooks.h"
#include "harness.h"

#include <stdlib.h>
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
    int64_t len = w->shape[dim], *hits = calloc((size_t)len + 1, sizeof *hits);
    int ok = hits != NULL;
    for (int k = 0; ok && k < T; k++) {
        int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
        int n;
        ok = mdt_shard_ranges(w, T, k, st, ln, &n) == MDT_OK;
        for (int b = 0; ok && b < n; b++)
            for (int64_t i = st[b]; ok && i < st[b] + ln[b]; i++)
                ok = i >= 0 && i < len && ++hits[i] > 0;
    }
    for (int64_t i = 0; ok && i < len; i++)
        ok = hits[i] == 1;
    free(hits);
    return ok;
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
    EXPECT_OK(mdt_shard_local_shape(&po, 2, 1, loc));
    EXPECT(loc[0] == 32 && loc[1] == 80, "packed local shape");
    for (int T = 1; T <= 16; T *= 2)
        EXPECT(tiles_exactly(&po, T), "packed tiles at T=%d", T);

    mdt_weight_spec col = spec("ff.net.0.proj.weight", 128, 32, MDT_TP_COLWISE);
    EXPECT_OK(mdt_shard_ranges(&col, 4, 3, st, ln, &n));
    EXPECT(n == 1 && st[0] == 96 && ln[0] == 32, "colwise k=3 of 4");
    EXPECT_OK(mdt_shard_local_shape(&col, 4, 3, loc));
    EXPECT(loc[0] == 32 && loc[1] == 32, "colwise local shape");
    mdt_weight_spec row = spec("attn.to_out.0.weight", 32, 64, MDT_TP_ROWWISE);
    EXPECT_OK(mdt_shard_local_shape(&row, 8, 5, loc));
    EXPECT(loc[0] == 32 && loc[1] == 8, "rowwise local shape");
    mdt_weight_spec ada = spec("norm1.linear.weight", 192, 32, MDT_TP_REPLICATED_INPUT_ROWWISE);
    EXPECT_OK(mdt_shard_local_shape(&ada, 4, 2, loc));
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

    /* uneven shards (Wan 14B's FFN 13824 at tp 5, 10, 20, 40; tiny widths against every T):
     * coordinate k owns base + (k < n mod T) contiguous rows in coordinate order, per block, and
     * its local shape says so; rank 0 holds the most; at a T that divides, the even split */
    int64_t widths[] = {13824, 41, 7, 5};
    int uneven_ok = 1;
    for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++)
        for (int T = 1; T <= 40; T++) {
            const int64_t F = widths[wi];
            if (F < T)
                continue;
            mdt_weight_spec c0 = spec("ffn.net.0.proj.weight", F, 24, MDT_TP_COLWISE);
            mdt_weight_spec c2 = spec("ffn.net.2.weight", 24, F, MDT_TP_ROWWISE);
            mdt_weight_spec gl = spec("ff.net.0.proj.weight", 2 * F, 24, MDT_TP_PACKED_COLWISE);
            c0.uneven = c2.uneven = gl.uneven = 1;
            gl.nblocks = 2, gl.blocks[0] = gl.blocks[1] = F;
            uneven_ok &= tiles_exactly(&c0, T) && tiles_exactly(&c2, T) && tiles_exactly(&gl, T);
            int64_t next = 0, sum = 0;
            for (int k = 0; k < T; k++) {
                const int64_t want = F / T + (k < F % T ? 1 : 0);
                uneven_ok &= mdt_shard_ranges(&c0, T, k, st, ln, &n) == MDT_OK && n == 1 &&
                             st[0] == next && ln[0] == want;
                uneven_ok &= mdt_shard_local_shape(&c0, T, k, loc) == MDT_OK && loc[0] == want &&
                             loc[1] == 24;
                uneven_ok &= mdt_shard_local_shape(&c2, T, k, loc) == MDT_OK && loc[0] == 24 &&
                             loc[1] == want;
                uneven_ok &= mdt_shard_ranges(&gl, T, k, st, ln, &n) == MDT_OK &&
                             (T == 1 ? n == 1 && ln[0] == 2 * F /* whole, one range */
                                     : n == 2 && st[0] == next && st[1] == F + next &&
                                           ln[0] == want && ln[1] == want);
                next += want, sum += loc[1];
            }
            uneven_ok &= sum == F && mdt_shard_uneven_at(&c0, T) == (F % T != 0);
            c0.uneven = 0; /* the same width without the flag: refused unless T divides */
            uneven_ok &= (mdt_shard_ranges(&c0, T, 0, st, ln, &n) == MDT_OK) == (F % T == 0);
            uneven_ok &= !mdt_shard_uneven_at(&c0, T);
            mdt_error_clear();
        }
    EXPECT(uneven_ok,
           "uneven shards: contiguous, first n mod T one longer, tiling, refused unflagged");
    mdt_weight_spec u = spec("blocks.0.ffn.net.0.proj.weight", 13824, 5120, MDT_TP_COLWISE);
    u.uneven = 1;
    EXPECT_OK(mdt_shard_ranges(&u, 5, 0, st, ln, &n));
    EXPECT(st[0] == 0 && ln[0] == 2765, "13824 over 5, coordinate 0: [0, 2765)");
    EXPECT_OK(mdt_shard_ranges(&u, 5, 4, st, ln, &n));
    EXPECT(st[0] == 11060 && ln[0] == 2764, "13824 over 5, coordinate 4: [11060, 13824)");
    EXPECT_OK(mdt_shard_local_shape(&u, 10, 3, loc));
    EXPECT(loc[0] == 1383 && loc[1] == 5120, "13824 over 10, coordinate 3 holds 1383 rows");
    EXPECT_OK(mdt_shard_local_shape(&u, 10, 4, loc));
    EXPECT(loc[0] == 1382, "13824 over 10, coordinate 4 holds 1382 rows");
    mdt_weight_spec small = spec("ffn.net.2.weight", 8, 3, MDT_TP_ROWWISE);
    small.uneven = 1;
    EXPECT_ERR(mdt_shard_ranges(&small, 4, 0, st, ln, &n), MDT_E_INVALID, "tp=4 exceeds",
               "ffn.net.2.weight", "size 3");
    /* negative control: the naive uneven split (even starts, uneven lengths) overlaps and
     * leaves the last rows unowned: the tiling check must catch it */
    const mdt_test_hooks naive = {.uneven_even_starts = 1};
    mdt_weight_spec c41 = spec("ffn.net.0.proj.weight", 41, 8, MDT_TP_COLWISE);
    c41.uneven = 1;
    mdt_test_hooks_set(&naive);
    EXPECT(!tiles_exactly(&c41, 3) && !tiles_exactly(&c41, 4), "naive uneven split caught");
    EXPECT(tiles_exactly(&col, 4), "the seam leaves even splits alone");
    mdt_test_hooks_set(NULL);
    EXPECT(tiles_exactly(&c41, 3) && tiles_exactly(&c41, 4), "the seam removed");

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
