/*
 * device.c — process set-up and device selection for a client (meshdit.h): log prefix, CPU
 * kernel set and GEMM path, the backend on each rank (and NCCL for its mesh groups), and what
 * is in force.
 */
#include "backend/backend.h"
#include "comm/mesh.h"
#include "core/core.h"

#include <mpi.h>
#include <string.h>

void mdt_set_log_rank(int world_rank) { mdt_log_set_rank(world_rank); }

mdt_status mdt_cpu_kernels_select(const char *isa, const char *gemm) {
    if (isa && *isa)
        MDT_TRY(mdt_cpu_isa_select(isa));
    if (gemm && *gemm)
        MDT_TRY(mdt_cpu_gemm_select(gemm));
    return MDT_OK;
}

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

void mdt_device_info_get(mdt_device_info *out) {
    memset(out, 0, sizeof *out);
    const mdt_device_ops *ops = mdt_backend_device_ops();
    out->backend = mdt_backend_name();
    out->gpu = ops != NULL;
    if (ops) {
        mdt_backend_describe(out->description, sizeof out->description);
        out->device_mem_peak = ops->mem_peak();
    }
    out->bf16 = mdt_backend_bf16();
    out->bf16_operands = out->bf16 && mdt_cpu_gemm_bf16_operands();
    out->cpu_kernels = mdt_cpu_isa();
    mdt_cpu_gemm_describe(out->cpu_gemm, sizeof out->cpu_gemm);
    out->scratch_bytes = mdt_backend_scratch_bytes();
}
