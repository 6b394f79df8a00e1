#!/usr/bin/env bash
# ring_overlap.sh — does the ring's next K|V block travel while the current one is attended?
# Runs the ring layout (tp 1 x ring N) of medium Flux with two builds, alternating them round by
# round: this tree's and a baseline (`--old DIR`, a checkout built with `make`), inside one host
# (MPICH, shared memory) or across namespace hosts with a shaped link (`--rate R`: Open MPI TCP,
# scripts/netns-cluster, needs root). Prints per build the median step and the slowest rank's
# ring compute and ring wait per step (the report's ring_per_step), medians over rounds.
# Never part of `make test`.
#
# usage: bench/ring_overlap.sh --old DIR [--rate 1gbit] [--ranks 2] [--rounds 3] [--repeat 3]
#                              [--img 1024] [--txt 256]
set -euo pipefail
cd "$(dirname "$0")/.."
OLD="" RATE="" N=2 ROUNDS=3 REPEAT=3 IMG=1024 TXT=256
while [ $# -gt 0 ]; do
    case "$1" in
    --old) OLD=$2; shift 2 ;; --rate) RATE=$2; shift 2 ;; --ranks) N=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;; --repeat) REPEAT=$2; shift 2 ;; --img) IMG=$2; shift 2 ;;
    --txt) TXT=$2; shift 2 ;;
    *) echo "usage: see the header of $0" >&2; exit 2 ;;
    esac
done
[ -n "$OLD" ] || { echo "ring_overlap.sh: --old DIR (a baseline checkout) is required" >&2; exit 2; }
unset OPENBLAS_CORETYPE
export OPENBLAS_NUM_THREADS=1
T=$(mktemp -d)
C=scripts/netns-cluster
if [ -n "$RATE" ]; then
    make -s MPI_PKG=ompi BUILD=build-ompi build-ompi/meshdit >/dev/null
    (cd "$OLD" && make -s MPI_PKG=ompi BUILD=build-ompi build-ompi/meshdit >/dev/null)
    NEW_BIN=build-ompi/meshdit OLD_BIN=$OLD/build-ompi/meshdit
    trap '$C down >/dev/null 2>&1; rm -rf "$T"' EXIT
    $C down >/dev/null 2>&1 || true
    $C up "$N" --rate "$RATE" >/dev/null
    H=$($C hosts 1)
    mp() { timeout 900 $C mpirun --host "$H" -n "$N" -x OPENBLAS_NUM_THREADS=1 "$@" </dev/null; }
    where="$N namespace hosts x 1 rank, links $RATE (tc token bucket), Open MPI TCP"
else
    make -s -j2 build/meshdit >/dev/null
    (cd "$OLD" && make -s -j2 build/meshdit >/dev/null)
    NEW_BIN=build/meshdit OLD_BIN=$OLD/build/meshdit
    trap 'rm -rf "$T"' EXIT
    MPIEXEC=$(command -v mpiexec.mpich || command -v mpiexec)
    mp() { timeout 900 "$MPIEXEC" -n "$N" "$@" </dev/null; }
    where="one host, $N ranks, MPICH (shared memory)"
fi
build/meshdit gen --model flux --preset medium --seed 1 --out "$T/ck" >/dev/null
build/meshdit inputs --checkpoint "$T/ck" --img-tokens "$IMG" --txt-tokens "$TXT" --seed 2 \
    --out "$T/in.safetensors" >/dev/null
for round in $(seq 1 "$ROUNDS"); do
    for b in new old; do
        bin=$NEW_BIN
        [ $b = old ] && bin=$OLD_BIN
        mp "$bin" run --checkpoint "$T/ck" --inputs "$T/in.safetensors" --ring "$N" \
            --repeat "$REPEAT" --out "$T/out.$b" --report "$T/rep.$b.$round" --quiet >/dev/null
    done
done
echo "ring overlap: flux medium, $IMG image + $TXT text tokens, f32, ring $N; $where; run --repeat $REPEAT median, $ROUNDS rounds"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python3 - "$T" "$ROUNDS" "$OLD" <<'EOF'
import json, statistics as st, sys
T, rounds, old = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def row(b):
    step, comp, wait = [], [], []
    for r in range(1, rounds + 1):
        rep = json.load(open(f"{T}/rep.{b}.{r}"))
        step.append(rep["step_seconds_median"])
        comp.append(max(k["ring_per_step"]["ring_compute_seconds"] for k in rep["ranks"]))
        wait.append(max(k["ring_per_step"]["ring_wait_seconds"] for k in rep["ranks"]))
    return st.median(step), st.median(comp), st.median(wait), step
res = {b: row(b) for b in ("new", "old")}
print("| build | step s (median) | ring compute s/step | ring wait s/step | steps by round |")
print("|---|---|---|---|---|")
for b, name in (("old", f"baseline ({old})"), ("new", "this tree")):
    s, c, w, steps = res[b]
    print(f"| {name} | {s:.3f} | {c:.3f} | {w:.3f} | {' '.join(f'{x:.3f}' for x in steps)} |")
print(f"\nstep time this tree / baseline: {res['new'][0] / res['old'][0]:.3f}")
EOF
