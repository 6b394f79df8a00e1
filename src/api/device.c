/*
 * device.c — process set-up and device selection for a client (meshdit.h): log prefix, the
 * backend on each rank (and NCCL for its mesh groups). The CPU kernel set and what is in force
 * are the backend's (backend.c).
 */
#include "backend/backend.h"
#include "comm/mesh.h"
#include "core/core.h"

#include <mpi.h>
#include <string.h>

void mdt_set_log_rank(int world_rank) { mdt_log_set_rank(world_rank); }

/* The backend on this rank's GPU (node-local rank modulo the GPUs) and, for comm "nccl" (or
 * "auto" with a GPU per rank), NCCL communicators per mesh group. */
mdt_status mdt_device_select(mdt_mesh *mesh, const char *device, const char *dtype,
                             const char *comm) {
    const int local = mesh ? mesh->node_rank : 0, nlocal = mesh ? mesh->node_size : 1;
    const int cuda = strcmp(device, "cuda") == 0, bf16 = strcmp(dtype, "bf16") == 0;
    mdt_status st = mdt_mesh_agree(
        mesh, mdt_backend_select(cuda ? MDT_BACKEND_CUDA : MDT_BACKEND_CPU, local, bf16));
    if (st != MDT_OK || !cuda || !mesh || mesh->world_size == 1)
        return st;
    const mdt_device_ops *ops = mdt_backend_device_ops();
    const int gpus = ops->device_count();
    if (strcmp(comm, "mpi") == 0 || (strcmp(comm, "auto") == 0 && nlocal > gpus))
        return MDT_OK; /* host-staged MPI (several ranks share a GPU: NCCL would refuse) */
    return mdt_mesh_use_comm(mesh, mdt_backend_device_comm());
}
