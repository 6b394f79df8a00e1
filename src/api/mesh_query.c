/*
 * mesh_query.c — the public face of the device mesh beyond create/free (meshdit.h): verdicts, the
 * stuck-peers flag, coordinates of a layout without a mesh.
 */
#include "comm/mesh.h"
#include "core/core.h"

mdt_status mdt_mesh_verdict(mdt_mesh *m, mdt_status local) { return mdt_mesh_agree(m, local); }

int mdt_mesh_peers_stuck(const mdt_mesh *m) { return m ? m->peers_stuck : 0; }

mdt_status mdt_mesh_coords_of(const char *order, int rank, int tp, int ring, int ulysses, int *t,
                              int *r, int *u) {
    mdt_axis ax[3];
    MDT_TRY(mdt_mesh_parse_order(order ? order : "tp,ring,ulysses", ax));
    mdt_mesh_coords(rank, tp, ring, ulysses, ax, t, r, u);
    return MDT_OK;
}
