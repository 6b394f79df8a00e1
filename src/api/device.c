/*
 * device.c — process set-up and device selection for a client (meshdit.h): log prefix, the
 * backend on each rank (and NCCL for its mesh groups). The CPU kernel set and what is in force
 * are the backend's (backend.c).
 */
#include "backend/backend.h"
#include "comm/mesh.h"
#include "core/core.h"

#include <mpi.h>
#include <stdio.h>
#include <string.h>

void mdt_set_log_rank(int world_rank) { mdt_log_set_rank(world_rank); }

/* The CPU's bf16 path, by measurement (backend.h): every rank measures, rank 0's verdict holds
 * for all (one arithmetic on every rank of a layout), and the plan line says why. */
static mdt_status choose_bf16(mdt_mesh *mesh) {
    int op = 0, asked = 0;
    double t[2] = {0, 0};
    const mdt_status st = mdt_mesh_agree(mesh, mdt_backend_measure_bf16(&op, &t[0], &t[1], &asked));
    if (st != MDT_OK)
        return st;
    double msg[4] = {(double)op, t[0], t[1], (double)asked};
    if (mesh && mesh->world_size > 1 &&
        MPI_Bcast(msg, 4, MPI_DOUBLE, 0, mesh->world) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "broadcasting the bf16 path failed");
    op = msg[0] != 0;
    char why[256];
    if (msg[1] > 0 && msg[2] > 0)
        snprintf(why, sizeof why,
                 "bf16 weights %s (measured on rank 0, a [256, 1024] x [1024, 1024] linear: bf16 "
                 "operands %.2f ms, widened %.2f ms; MESHDIT_CPU_BF16 chooses)",
                 op ? "as bf16 GEMM operands" : "widened to f32 for the f32 GEMM", 1e3 * msg[1],
                 1e3 * msg[2]);
    else /* not measured: the variable chose, or the path has no bf16 GEMM (auto) */
        snprintf(why, sizeof why, "bf16 weights %s (%s)",
                 op ? "as bf16 GEMM operands" : "widened to f32 for the f32 GEMM",
                 msg[3] != 0 ? "MESHDIT_CPU_BF16" : "no bf16 GEMM on this path");
    mdt_backend_set_bf16_operands(op, why);
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
    if (st == MDT_OK && !cuda && bf16)
        st = choose_bf16(mesh);
    if (st != MDT_OK || !cuda || !mesh || mesh->world_size == 1)
        return st;
    const mdt_device_ops *ops = mdt_backend_device_ops();
    const int gpus = ops->device_count();
    if (strcmp(comm, "mpi") == 0 || (strcmp(comm, "auto") == 0 && nlocal > gpus))
        return MDT_OK; /* host-staged MPI (several ranks share a GPU: NCCL would refuse) */
    return mdt_mesh_use_comm(mesh, mdt_backend_device_comm());
}
