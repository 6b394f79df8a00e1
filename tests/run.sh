#!/usr/bin/env bash
# run.sh — `make test`: every unit test binary, then the command-line tests; sums their
# "N passed, N failed" lines into one closing line and fails if anything failed.
set -u
BUILD=${BUILD:-build}
export OPENBLAS_NUM_THREADS=1
total_pass=0 total_fail=0 broken=0
run() {
    local out rc
    out=$("$@" 2>&1); rc=$?
    printf '%s\n' "$out" | grep -v '^$' | sed 's/^/  /'
    local line; line=$(printf '%s\n' "$out" | grep -E '[0-9]+ passed, [0-9]+ failed' | tail -1)
    if [ -z "$line" ]; then
        echo "  ^ $* ended (exit $rc) without a result line"; broken=$((broken + 1)); return
    fi
    local p f
    p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed.*/\1/; s/^([0-9]+) passed.*/\1/')
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    total_pass=$((total_pass + p)); total_fail=$((total_fail + f))
    [ "$rc" = 0 ] || [ "$f" != 0 ] || { echo "  ^ $* exited $rc"; broken=$((broken + 1)); }
}
for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    echo "== $(basename "$t")"
    run "$t"
done
MPIEXEC=${MPIEXEC:-$(command -v mpiexec.mpich || command -v mpiexec)}
echo "== mpi (tensor parallelism, shard-on-read loader)"
for layout in "1 1 1 1 tp,ring,ulysses" "2 2 1 1 tp,ring,ulysses" "2 2 1 1 ring,ulysses,tp" \
              "4 4 1 1 tp,ring,ulysses" "4 2 2 1 tp,ring,ulysses" "4 2 1 2 ring,ulysses,tp"; do
    set -- $layout
    run timeout 300 "$MPIEXEC" -n "$1" "$BUILD/tests/mpi/test_tp" tests/data "$2" "$3" "$4" "$5"
done
# negative control: with the shard index taken from the world rank (the upstream bug) on a
# 2-axis mesh, the loader test must fail
if MESHDIT_TEST_SHARD_INDEX=world timeout 300 "$MPIEXEC" -n 4 "$BUILD/tests/mpi/test_tp" tests/data 2 2 1 \
        tp,ring,ulysses >/dev/null 2>&1; then
    echo "  negative control: the world-rank shard index bug went unnoticed"; total_fail=$((total_fail + 1))
else
    echo "  negative control: world-rank shard index caught"; total_pass=$((total_pass + 1))
fi
echo "== cli"
run env BIN="$BUILD/meshdit" MPIEXEC="$MPIEXEC" bash tests/cli/test_cli.sh
total_fail=$((total_fail + broken))
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" = 0 ]
