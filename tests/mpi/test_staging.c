/*
 * test_staging.c — the host-staged path of the collectives (device buffers copied through host
 * memory around plain MPI, what several ranks sharing one GPU use) without a GPU: a fake device
 * memory source whose "device" buffers are host allocations it keeps a registry of, with copies
 * that count themselves. Every collective must give on "device" buffers exactly what it gives on
 * host buffers, and must have staged (copied) exactly when a buffer is "device" memory.
 *
 * usage: mpiexec -n 4 build/tests/mpi/test_staging   (2 x 2 mesh: tp=2, ulysses=2)
 */
#define _POSIX_C_SOURCE 200809L
#include "comm/mesh.h"
#include "harness.h"

#include <stdlib.h>
#include <string.h>

enum { MAX_FAKE = 64 };
static void *g_fake[MAX_FAKE];
static size_t g_fake_n[MAX_FAKE];
static int g_to_host, g_to_dev, g_rank;

static void *fake_alloc(size_t n) {
    for (int i = 0; i < MAX_FAKE; i++)
        if (!g_fake[i]) {
            g_fake[i] = calloc(1, n ? n : 1), g_fake_n[i] = n;
            return g_fake[i];
        }
    return NULL;
}
static void fake_free(void *p) {
    for (int i = 0; i < MAX_FAKE; i++)
        if (p && g_fake[i] == p) {
            g_fake[i] = NULL;
            free(p);
            return;
        }
}
static int fake_is_device(const void *p) {
    for (int i = 0; i < MAX_FAKE; i++)
        if (g_fake[i] && (const char *)p >= (const char *)g_fake[i] &&
            (const char *)p < (const char *)g_fake[i] + g_fake_n[i])
            return 1;
    return 0;
}
static void fake_to_host(void *dst, const void *src, size_t n) {
    EXPECT(fake_is_device(src) && !fake_is_device(dst), "to_host from host memory");
    memcpy(dst, src, n), g_to_host++;
}
static void fake_to_device(void *dst, const void *src, size_t n) {
    EXPECT(fake_is_device(dst) && !fake_is_device(src), "to_device into host memory");
    memcpy(dst, src, n), g_to_dev++;
}
static const mdt_mem_source k_fake = {.alloc = fake_alloc,
                                      .free = fake_free,
                                      .what = "fake device",
                                      .is_device = fake_is_device,
                                      .to_host = fake_to_host,
                                      .to_device = fake_to_device,
                                      .host_alloc = NULL,
                                      .host_free = NULL};

static float *dev_copy(const float *h, int64_t n) {
    float *d = fake_alloc(sizeof(float) * (size_t)n);
    memcpy(d, h, sizeof(float) * (size_t)n); /* setup, not a counted transfer */
    return d;
}

/* bitwise equality of n floats */
static int same_bits(const void *a, const void *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

static float val(int rank, int64_t i) { return (float)(rank * 1000 + i % 997) * 0.5f - 3.0f; }

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    mdt_mesh *mesh = NULL;
    EXPECT_OK(
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 2, 1, 2, "tp,ring,ulysses"}, &mesh));
    if (!mesh) {
        MPI_Finalize();
        return 1;
    }
    mdt_mem_set_device(&k_fake);
    const int64_t n = 1001; /* not a multiple of the group size: the all-reduce pads */
    float *h = malloc(sizeof(float) * n), *hd;
    for (int64_t i = 0; i < n; i++)
        h[i] = val(g_rank, i);

    /* all-reduce over TP: device result == host result, bit for bit; copies only for device */
    float *d = dev_copy(h, n);
    g_to_host = g_to_dev = 0;
    EXPECT_OK(mdt_allreduce_sum(mesh, MDT_GROUP_TP, h, n));
    EXPECT(g_to_host == 0 && g_to_dev == 0, "host all-reduce staged (%d, %d)", g_to_host, g_to_dev);
    EXPECT_OK(mdt_allreduce_sum(mesh, MDT_GROUP_TP, d, n));
    EXPECT(g_to_host == 1 && g_to_dev == 1, "device all-reduce: %d/%d copies", g_to_host, g_to_dev);
    EXPECT(same_bits(h, d, n), "all-reduce: device result differs from host");

    /* all-to-all over Ulysses with uneven blocks */
    const int U = mesh->U;
    int64_t sc[2], sd[2], rc[2], rd[2], stot = 0, rtot = 0;
    for (int j = 0; j < U; j++) {
        sc[j] = 10 + 7 * j + g_rank, sd[j] = stot, stot += sc[j];
    }
    int64_t all_sc[8][2];
    for (int j = 0; j < U; j++) { /* what member j sends me: its sc[me] = 10 + 7 me + its rank */
        const int peer = (g_rank / U) * U + j;
        all_sc[j][0] = 10 + 7 * mesh->u + peer;
        rc[j] = all_sc[j][0], rd[j] = rtot, rtot += rc[j];
    }
    float *hs = malloc(sizeof(float) * stot), *hr = calloc((size_t)rtot, sizeof(float));
    for (int64_t i = 0; i < stot; i++)
        hs[i] = val(g_rank, i + 5);
    float *ds = dev_copy(hs, stot), *dr = fake_alloc(sizeof(float) * (size_t)rtot);
    EXPECT_OK(mdt_alltoallv_floats(mesh, MDT_GROUP_ULYSSES, hs, sc, sd, hr, rc, rd));
    g_to_host = g_to_dev = 0;
    EXPECT_OK(mdt_alltoallv_floats(mesh, MDT_GROUP_ULYSSES, ds, sc, sd, dr, rc, rd));
    EXPECT(g_to_host == 1 && g_to_dev == 1, "device all-to-all: %d/%d copies", g_to_host, g_to_dev);
    EXPECT(same_bits(hr, dr, rtot), "all-to-all: device result differs");
    /* and it is right: the block from member j is j's values at my offset */
    int right = 1;
    for (int j = 0; j < U; j++) {
        const int peer = (g_rank / U) * U + j;
        int64_t off = 0; /* peer's send displacement for me: sum of its counts before me */
        for (int k = 0; k < mesh->u; k++)
            off += 10 + 7 * k + peer;
        for (int64_t i = 0; i < rc[j]; i++)
            right &= hr[rd[j] + i] == val(peer, off + i + 5);
    }
    EXPECT(right, "all-to-all delivered the wrong blocks");

    /* all-gather(v) over the CP group (= Ulysses here) */
    int64_t counts[2] = {5, 9};
    float *hg = calloc(14, sizeof(float)), *dg = fake_alloc(sizeof(float) * 14);
    hd = dev_copy(h, 9);
    EXPECT_OK(mdt_allgatherv_floats(mesh, MDT_GROUP_CP, h, hg, counts));
    EXPECT_OK(mdt_allgatherv_floats(mesh, MDT_GROUP_CP, hd, dg, counts));
    EXPECT(same_bits(hg, dg, 14), "all-gather: device result differs");

    /* ring step over Ulysses (used as a ring of 2): start stages the send, wait the receive */
    float *rs = dev_copy(h, 64), *rr = fake_alloc(sizeof(float) * 64), *hrr = calloc(64, 4);
    mdt_ring_req rq;
    EXPECT_OK(mdt_ring_start(mesh, MDT_GROUP_ULYSSES, h, hrr, 64, &rq));
    EXPECT_OK(mdt_ring_wait(mesh, &rq));
    g_to_host = g_to_dev = 0;
    EXPECT_OK(mdt_ring_start(mesh, MDT_GROUP_ULYSSES, rs, rr, 64, &rq));
    EXPECT(g_to_host == 1 && g_to_dev == 0, "ring start: %d/%d copies", g_to_host, g_to_dev);
    EXPECT_OK(mdt_ring_wait(mesh, &rq));
    EXPECT(g_to_dev == 1, "ring wait did not move the block to the device");
    EXPECT(same_bits(rr, hrr, 64), "ring: device result differs");

    mdt_mem_set_device(NULL);
    mdt_mesh_free(mesh); /* staging buffers came from mdt_alloc (no host_alloc in the fake) */
    free(h), free(hs), free(hr), free(hg), free(hrr);
    fake_free(d), fake_free(ds), fake_free(dr), fake_free(dg), fake_free(hd), fake_free(rs);
    fake_free(rr);
    MPI_TEST_END(g_rank);
}
