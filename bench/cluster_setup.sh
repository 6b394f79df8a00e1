# cluster_setup.sh — sourced by the namespace-cluster benchmarks (cluster_plan.sh, cluster_cfg.sh):
# one thread per rank with OPENBLAS_CORETYPE unset, both builds (MPICH for the single-host runs,
# Open MPI for mpirun across the hosts), a temp dir T, and the cluster taken down on exit.
unset OPENBLAS_CORETYPE
export OPENBLAS_NUM_THREADS=1
C=scripts/netns-cluster
BIN=build-ompi/meshdit
make -s -j2 build/meshdit >/dev/null
make -s MPI_PKG=ompi BUILD=build-ompi build-ompi/meshdit >/dev/null
T=$(mktemp -d)
trap '$C down >/dev/null 2>&1; rm -rf "$T"' EXIT
$C down >/dev/null 2>&1 || true
