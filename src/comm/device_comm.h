/*
 * device_comm.h — the collectives a device library provides on device buffers (NCCL, in
 * comm/nccl.cu, built into the CUDA plugin and loaded at run time with it). The mesh uses this
 * table once mdt_mesh_use_comm has made one communicator per group; whoever loads the plugin
 * (backend.c) hands the table to the caller, so comm/ never reaches into backend/.
 *
 * Plain C, no meshdit headers: the plugin is compiled against this file alone.
 */
#ifndef MDT_COMM_DEVICE_COMM_H
#define MDT_COMM_DEVICE_COMM_H

#include <stddef.h>
#include <stdint.h>

#define MDT_DEVICE_COMM_ABI 1

typedef struct mdt_device_comm {
    int abi; /* MDT_DEVICE_COMM_ABI */
    /* id: 128 bytes made by one rank and broadcast; 0 or -1. */
    int (*comm_id)(void *id128);
    /* A communicator of nranks with this rank's place; NULL with a one-line reason in err. */
    void *(*comm_init)(int nranks, const void *id128, int rank, char *err, size_t errlen);
    void (*comm_free)(void *comm);
    /* Bit-identical sum: reduce-scatter then all-gather (n padded by the library). */
    int (*comm_allreduce)(void *comm, float *buf, int64_t n, int nranks);
    /* Grouped sends/receives: to/from every peer p, counts in floats (0 = skip). */
    int (*comm_alltoallv)(void *comm, int nranks, const float *send, const int64_t *scounts,
                          const int64_t *sdispls, float *recv, const int64_t *rcounts,
                          const int64_t *rdispls);
    /* Ring step on the communication stream: send n floats to `to`, receive from `from`;
     * returns at once, `comm_wait` makes the compute stream wait for it. */
    int (*comm_sendrecv)(void *comm, const float *send, int to, float *recv, int from, int64_t n);
    int (*comm_wait)(void *comm);
} mdt_device_comm;

/* The symbol the CUDA plugin exports for its collectives (absent: no device collectives). */
typedef const mdt_device_comm *(*mdt_device_comm_entry_fn)(void);
#define MDT_DEVICE_COMM_ENTRY "mdt_cuda_comm"

#endif /* MDT_COMM_DEVICE_COMM_H */
