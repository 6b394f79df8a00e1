/*
 * nccl.cu — device collectives over NCCL (comm/device_comm.h), built into the CUDA plugin with
 * kernels/cuda and running on its streams: all-reduce (bit-identical: reduce-scatter then
 * all-gather), grouped all-to-all, and the ring step on the communication stream. NCCL is opened
 * with dlopen on first use (libnccl.so.2), so the plugin loads on machines without it and the
 * collectives then fall back to the host-staged MPI path.
 */
#include "comm/device_comm.h"
#include "kernels/cuda/cuda_common.cuh"

#include <dlfcn.h>

namespace mdt_cuda {

/* The few NCCL types and entry points used, declared here (their ABI is stable since NCCL 2.0)
 * so that building needs no nccl.h and running needs libnccl only when a communicator is made. */
typedef struct ncclComm *ncclComm_t;
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclFloat = 7, ncclSum = 0 };
static struct {
    int tried, ok;
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommUserRank)(ncclComm_t, int *);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t);
} nccl;

static int nccl_load(char *err, size_t errlen) {
    if (nccl.tried)
        return nccl.ok ? 0 : (snprintf(err, errlen, "libnccl.so.2 could not be loaded"), -1);
    nccl.tried = 1;
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "libnccl.so.2: %s", dlerror());
        return -1;
    }
#define NCCL_SYM(f)                                                                                \
    if (!(*(void **)(&nccl.f) = dlsym(h, "nccl" #f))) {                                          \
        snprintf(err, errlen, "libnccl.so.2 has no nccl" #f);                                    \
        return -1;                                                                                 \
    }
    NCCL_SYM(GetUniqueId)
    NCCL_SYM(CommInitRank)
    NCCL_SYM(CommDestroy)
    NCCL_SYM(CommUserRank)
    NCCL_SYM(ReduceScatter)
    NCCL_SYM(AllGather)
    NCCL_SYM(Send)
    NCCL_SYM(Recv)
    NCCL_SYM(GroupStart)
    NCCL_SYM(GroupEnd)
    NCCL_SYM(GetErrorString)
#undef NCCL_SYM
    nccl.ok = 1;
    return 0;
}

typedef struct dev_comm {
    ncclComm_t comm;
    cudaEvent_t ready, done;
    float *pad; /* all-reduce buffer padded to a multiple of the group size */
    size_t pad_n;
} dev_comm;

static int nccl_ok(ncclResult_t r, const char *what) {
    if (r == ncclSuccess)
        return 0;
    fail("%s: %s", what, nccl.GetErrorString(r));
    return -1;
}

static int be_comm_id(void *id128) {
    ncclUniqueId id;
    char err[256];
    if (nccl_load(err, sizeof err) != 0 || nccl.GetUniqueId(&id) != ncclSuccess)
        return -1;
    memcpy(id128, &id, sizeof id < 128 ? sizeof id : 128);
    return 0;
}

static void *be_comm_init(int nranks, const void *id128, int rank, char *err, size_t errlen) {
    dev_comm *c = (dev_comm *)calloc(1, sizeof *c);
    ncclUniqueId id;
    memcpy(&id, id128, sizeof id);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (nccl_load(err, errlen) != 0) {
        free(c);
        return NULL;
    }
    ncclResult_t r = nccl.CommInitRank(&c->comm, nranks, id, rank);
    if (r != ncclSuccess) {
        snprintf(err, errlen, "ncclCommInitRank: %s", nccl.GetErrorString(r));
        free(c);
        return NULL;
    }
    cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    return c;
}

static void be_comm_free(void *p) {
    dev_comm *c = (dev_comm *)p;
    if (!c)
        return;
    nccl.CommDestroy(c->comm);
    cudaEventDestroy(c->ready);
    cudaEventDestroy(c->done);
    cudaFree(c->pad);
    free(c);
}

static int be_comm_allreduce(void *p, float *buf, int64_t n, int P) {
    dev_comm *c = (dev_comm *)p;
    int rank = 0;
    const size_t chunk = (size_t)((n + P - 1) / P);
    if (chunk * P > c->pad_n) {
        cudaFree(c->pad);
        c->pad = NULL, c->pad_n = 0;
        if (ck(cudaMalloc(&c->pad, sizeof(float) * chunk * P), "all-reduce buffer"))
            return -1;
        c->pad_n = chunk * P;
    }
    nccl.CommUserRank(c->comm, &rank);
    ck(cudaMemsetAsync(c->pad, 0, sizeof(float) * chunk * P, g_stream), "all-reduce pad");
    ck(cudaMemcpyAsync(c->pad, buf, sizeof(float) * n, cudaMemcpyDeviceToDevice, g_stream),
       "all-reduce copy");
    /* each element summed by exactly one rank, then copied to all: bit-identical everywhere */
    if (nccl_ok(nccl.ReduceScatter(c->pad, c->pad + rank * chunk, chunk, ncclFloat, ncclSum,
                                  c->comm, g_stream),
                "ncclReduceScatter") ||
        nccl_ok(nccl.AllGather(c->pad + rank * chunk, c->pad, chunk, ncclFloat, c->comm, g_stream),
                "ncclAllGather"))
        return -1;
    ck(cudaMemcpyAsync(buf, c->pad, sizeof(float) * n, cudaMemcpyDeviceToDevice, g_stream),
       "all-reduce copy");
    return g_failed ? -1 : 0;
}

static int be_comm_alltoallv(void *p, int P, const float *send, const int64_t *sc,
                             const int64_t *sd, float *recv, const int64_t *rc,
                             const int64_t *rd) {
    dev_comm *c = (dev_comm *)p;
    if (nccl_ok(nccl.GroupStart(), "ncclGroupStart"))
        return -1;
    for (int i = 0; i < P; i++) {
        if (sc[i])
            nccl_ok(nccl.Send(send + sd[i], (size_t)sc[i], ncclFloat, i, c->comm, g_stream),
                    "ncclSend");
        if (rc[i])
            nccl_ok(nccl.Recv(recv + rd[i], (size_t)rc[i], ncclFloat, i, c->comm, g_stream),
                    "ncclRecv");
    }
    nccl_ok(nccl.GroupEnd(), "ncclGroupEnd");
    return g_failed ? -1 : 0;
}

static int be_comm_sendrecv(void *p, const float *send, int to, float *recv, int from, int64_t n) {
    dev_comm *c = (dev_comm *)p;
    /* the block to send was written on the compute stream: the comm stream waits for it */
    ck(cudaEventRecord(c->ready, g_stream), "ring event");
    ck(cudaStreamWaitEvent(g_comm, c->ready, 0), "ring wait");
    nccl_ok(nccl.GroupStart(), "ncclGroupStart");
    nccl_ok(nccl.Send(send, (size_t)n, ncclFloat, to, c->comm, g_comm), "ncclSend");
    nccl_ok(nccl.Recv(recv, (size_t)n, ncclFloat, from, c->comm, g_comm), "ncclRecv");
    nccl_ok(nccl.GroupEnd(), "ncclGroupEnd");
    return g_failed ? -1 : 0;
}

static int be_comm_wait(void *p) {
    dev_comm *c = (dev_comm *)p;
    ck(cudaEventRecord(c->done, g_comm), "ring event");
    ck(cudaStreamWaitEvent(g_stream, c->done, 0), "ring wait");
    return g_failed ? -1 : 0;
}

} // namespace mdt_cuda

static mdt_device_comm k_comm;

extern "C" __attribute__((visibility("default"))) const mdt_device_comm *mdt_cuda_comm(void) {
    mdt_device_comm *o = &k_comm;
    o->abi = MDT_DEVICE_COMM_ABI;
    o->comm_id = mdt_cuda::be_comm_id, o->comm_init = mdt_cuda::be_comm_init;
    o->comm_free = mdt_cuda::be_comm_free, o->comm_allreduce = mdt_cuda::be_comm_allreduce;
    o->comm_alltoallv = mdt_cuda::be_comm_alltoallv, o->comm_sendrecv = mdt_cuda::be_comm_sendrecv;
    o->comm_wait = mdt_cuda::be_comm_wait;
    return o;
}
