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
# the kernels again with oneDNN capped below its widest (each cap is once per process): the
# AVX512-BF16 kernels an AMX CPU would skip, and oneDNN's AVX2 f32 kernels
has_flag() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }
if has_flag amx_bf16 && has_flag avx512_bf16; then
    echo "== test_kernels, oneDNN capped at AVX512-BF16"
    run env MESHDIT_CPU_GEMM=onednn-avx512bf16 "$BUILD/tests/test_kernels"
fi
if has_flag avx2 && has_flag fma; then
    echo "== test_kernels, oneDNN capped at AVX2"
    run env MESHDIT_CPU_GEMM=onednn-avx2 "$BUILD/tests/test_kernels"
fi
echo "== fuzz corpora and saved crash inputs, replayed"
for r in "$BUILD"/tests/replay_*; do
    [ -x "$r" ] || continue
    t=${r##*/replay_}
    files=$(find tests/fuzz/corpus/"$t" tests/fuzz/regress/"$t" -type f ! -name .keep 2>/dev/null)
    # shellcheck disable=SC2086
    run "$r" $files
done
MPIEXEC=${MPIEXEC:-$(command -v mpiexec.mpich || command -v mpiexec)}
if [ -n "${SANITIZE:-}" ]; then
    # Processes that initialise MPI leak a few hundred bytes inside MPICH's dlopen'ed transport
    # plugins (reported from "<unknown module>", nothing LSan can suppress by name); leak checks
    # stay on for the unit tests above, and our own accounting (mdt_mem_live) covers the rest.
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
fi
echo "== mpi (tensor and context parallelism, shard-on-read loader)"
# n T R U order: TP alone, every CP mode alone and combined with TP, both mesh orders, uneven
# token counts (flux_guidance: 37 + 11) and head counts not divisible by T x U (U=3; tiny at T=2 U=2)
LAYOUTS=("1 1 1 1 tp,ring,ulysses" "2 2 1 1 tp,ring,ulysses" "4 4 1 1 tp,ring,ulysses"
         "2 1 1 2 tp,ring,ulysses" "2 1 2 1 tp,ring,ulysses" "4 1 2 2 tp,ring,ulysses"
         "4 1 2 2 ring,ulysses,tp" "4 1 1 4 tp,ring,ulysses" "3 1 1 3 tp,ring,ulysses"
         "3 1 3 1 tp,ring,ulysses" "4 2 1 2 tp,ring,ulysses" "4 2 1 2 ring,ulysses,tp"
         "4 2 2 1 tp,ring,ulysses" "4 2 2 1 ring,ulysses,tp" "8 2 2 2 tp,ring,ulysses"
         "8 2 2 2 ring,ulysses,tp")
for layout in "${LAYOUTS[@]}"; do
    set -- $layout
    run timeout 600 "$MPIEXEC" -n "$1" "$BUILD/tests/mpi/test_parallel" tests/data "$2" "$3" "$4" "$5"
done
# bf16 linear weights on the CPU backend (bf16 GEMM operands where the CPU has bf16
# instructions): loader, gather, in-memory path and forwards on every layout above
for layout in "${LAYOUTS[@]}"; do
    set -- $layout
    run env MESHDIT_TEST_DTYPE=bf16 timeout 600 "$MPIEXEC" -n "$1" "$BUILD/tests/mpi/test_parallel" \
        tests/data "$2" "$3" "$4" "$5"
done
# the baseline x86-64 kernel set (what a CPU without AVX2 runs) on a hybrid layout
if [ "$(uname -m)" = x86_64 ]; then
    run env MESHDIT_CPU_ISA=x86-64 timeout 600 "$MPIEXEC" -n 4 "$BUILD/tests/mpi/test_parallel" \
        tests/data 2 1 2 tp,ring,ulysses
fi
# the GEMM path auto did not pick (gemm.h): OpenBLAS where auto is oneDNN (CPUs with bf16
# instructions), oneDNN where auto is OpenBLAS; f32 and bf16 weights, on a hybrid layout
other=openblas
has_flag avx512_bf16 || has_flag amx_bf16 || other=onednn
for dt in f32 bf16; do
    run env MESHDIT_CPU_GEMM=$other MESHDIT_TEST_DTYPE=$dt timeout 600 "$MPIEXEC" -n 4 \
        "$BUILD/tests/mpi/test_parallel" tests/data 2 2 1 tp,ring,ulysses
done
# LoRA adapters fused shard by shard: one rank, tp=2, tp=2 x ulysses=2, and bf16 weights at tp=2
run timeout 600 "$MPIEXEC" -n 1 "$BUILD/tests/mpi/test_lora" tests/data 1 1 1
run timeout 600 "$MPIEXEC" -n 2 "$BUILD/tests/mpi/test_lora" tests/data 2 1 1
run timeout 600 "$MPIEXEC" -n 4 "$BUILD/tests/mpi/test_lora" tests/data 2 1 2
run env MESHDIT_TEST_DTYPE=bf16 timeout 600 "$MPIEXEC" -n 2 "$BUILD/tests/mpi/test_lora" tests/data 2 1 1
run timeout 300 "$MPIEXEC" -n 2 "$BUILD/tests/mpi/test_failures" tests/data
# the hypervisor's steal per rank and per forward in the run report (a fake proc/stat per rank)
run timeout 300 "$MPIEXEC" -n 2 "$BUILD/tests/mpi/test_steal" tests/data
run timeout 300 "$MPIEXEC" -n 4 "$BUILD/tests/mpi/test_staging"
run timeout 300 "$MPIEXEC" -n 2 "$BUILD/tests/mpi/test_ring"
for p in 2 3 4; do run timeout 300 "$MPIEXEC" -n $p "$BUILD/tests/mpi/test_allreduce"; done
# negative controls: each switch reproduces an upstream bug; the tests must notice it
negative() { # name env -- n T R U order
    local name=$1 envv=$2; shift 3
    if env "$envv" timeout 600 "$MPIEXEC" -n "$1" "$BUILD/tests/mpi/test_parallel" tests/data "$2" "$3" "$4" "$5" \
            >/dev/null 2>&1; then
        echo "  negative control $name: went unnoticed"; total_fail=$((total_fail + 1))
    else
        echo "  negative control $name: caught"; total_pass=$((total_pass + 1))
    fi
}
negative "world-rank shard index, tp=2 x ring=2" MESHDIT_TEST_SHARD_INDEX=world -- 4 2 2 1 tp,ring,ulysses
negative "world-rank shard index, tp=2 x ulysses=2" MESHDIT_TEST_SHARD_INDEX=world -- 4 2 1 2 tp,ring,ulysses
negative "CP split skipped, ring=2 x ulysses=2" MESHDIT_TEST_SKIP_CP_SPLIT=1 -- 4 1 2 2 tp,ring,ulysses
# an uneven FFN split whose shards start where even ones would (overlapping by a row, the last
# rows never read): the slices, the forwards and the gather must all notice, at tp=2 and tp=4
negative "uneven shards at even starts, tp=2" MESHDIT_TEST_UNEVEN_EVEN_STARTS=1 -- 2 2 1 1 tp,ring,ulysses
negative "uneven shards at even starts, tp=4" MESHDIT_TEST_UNEVEN_EVEN_STARTS=1 -- 4 4 1 1 tp,ring,ulysses
echo "== cli"
run env BIN="$BUILD/meshdit" MPIEXEC="$MPIEXEC" bash tests/cli/test_cli.sh
echo "== serve (the resident server over ZeroMQ, a C client)"
run timeout 300 env BIN="$BUILD/meshdit" CLIENT="$BUILD/tests/serve_client" MPIEXEC="$MPIEXEC" \
    bash tests/cli/test_serve.sh
# the hostile-input campaign's quick subset (docs/reliability.md), strict: a case in a bad class
# (crash, hang, NaN output, output left behind, unclean error) fails. The script is Python
# (standard library); make test needs no Python, so without python3 it is skipped, said so.
echo "== reliability campaign, quick, strict"
if command -v python3 >/dev/null; then
    run timeout 300 python3 scripts/reliability-campaign --quick --strict --bin "$BUILD/meshdit" \
        --mpiexec "$MPIEXEC"
else
    echo "  skipped: no python3 on this machine"
fi
total_fail=$((total_fail + broken))
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" = 0 ]
