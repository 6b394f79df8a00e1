#!/usr/bin/env bash
# cluster_plan.sh — the planner checked against the test cluster (issue 18): N namespace hosts
# (scripts/netns-cluster) with shaped links, `meshdit plan --calibrate` run across them, the
# plan's prediction for every layout of the cluster's ranks, and each layout measured
# (`run --repeat`, the report's median step). Prints a markdown table: predicted vs measured,
# the error, and both rank orders. Rounds alternate calibration and measurement, so a machine
# whose speed drifts (a shared VM) is measured as it was calibrated. Needs root and Open MPI
# (scripts/install-deps); never part of `make test`.
#
# usage: bench/cluster_plan.sh [--hosts H] [--per-host K] [--rate 1gbit] [--rounds 2]
#                              [--preset medium] [--img 1024] [--txt 256] [--repeat 3]
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=2 PER=1 RATE=1gbit ROUNDS=2 PRESET=medium IMG=1024 TXT=256 REPEAT=3
while [ $# -gt 0 ]; do
    case "$1" in
    --hosts) HOSTS=$2; shift 2 ;; --per-host) PER=$2; shift 2 ;; --rate) RATE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;; --preset) PRESET=$2; shift 2 ;; --img) IMG=$2; shift 2 ;;
    --txt) TXT=$2; shift 2 ;; --repeat) REPEAT=$2; shift 2 ;;
    *) echo "usage: see the header of $0" >&2; exit 2 ;;
    esac
done
. bench/cluster_setup.sh # env, builds, $C, $BIN, $T, the cluster down on exit
$C up "$HOSTS" --rate "$RATE" >/dev/null
N=$((HOSTS * PER)) S=$((IMG + TXT)) H=$($C hosts "$PER")
build/meshdit gen --model flux --preset "$PRESET" --seed 1 --out "$T/ck" >/dev/null
build/meshdit inputs --checkpoint "$T/ck" --img-tokens "$IMG" --txt-tokens "$TXT" --seed 2 \
    --out "$T/in.safetensors" >/dev/null
mp() { timeout 900 $C mpirun --host "$H" -n "$N" -x OPENBLAS_NUM_THREADS=1 "$@" </dev/null; }

# every tp x ring x ulysses of N ranks the model takes (the plan's own list)
layouts=$(build/meshdit plan --checkpoint "$T/ck" --devices "$N" --tokens "$S" --device cpu |
    awk '/^[0-9]+ x [0-9]+ x [0-9]+ / && !/rejected/ {print $1 "," $3 "," $5}')
for round in $(seq 1 "$ROUNDS"); do
    mp $BIN plan --checkpoint "$T/ck" --calibrate "$T/dev$round.json" --tokens "$S" >"$T/cal$round"
    build/meshdit plan --checkpoint "$T/ck" --device-file "$T/dev$round.json" --devices "$N" \
        --tokens "$S" --txt-tokens "$TXT" --bytes 4 >"$T/plan$round"
    for l in $layouts; do
        IFS=, read -r t r u <<<"$l"
        mp $BIN run --checkpoint "$T/ck" --inputs "$T/in.safetensors" --tp "$t" --ring "$r" \
            --ulysses "$u" --repeat "$REPEAT" --out "$T/out" --report "$T/rep" --quiet >/dev/null
        cp "$T/rep" "$T/rep.$round.$t.$r.$u"
    done
done
echo "cluster: $HOSTS hosts x $PER ranks, links $RATE (tc token bucket); flux $PRESET, $IMG image + $TXT text tokens, f32; run --repeat $REPEAT median"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python3 - "$T" "$ROUNDS" "$layouts" <<'EOF'
import json, re, statistics as st, sys
T, rounds, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
keys = [tuple(map(int, l.split(","))) for l in layouts]
pred, meas, kern = {k: [] for k in keys}, {k: [] for k in keys}, {k: [] for k in keys}
for rnd in range(1, rounds + 1):
    cal = [l.strip() for l in open(f"{T}/cal{rnd}") if l.startswith("  ")]
    print(f"round {rnd} calibration: " + "; ".join(cal))
    for line in open(f"{T}/plan{rnd}"):
        m = re.match(r"(\d+) x (\d+) x (\d+) .* ([\d.]+)(  <- best)?$", line.rstrip())
        if m and "rejected" not in line:
            pred[(int(m[1]), int(m[2]), int(m[3]))].append(float(m[4]))
    for k in keys:
        rep = json.load(open(f"{T}/rep.{rnd}.{k[0]}.{k[1]}.{k[2]}"))
        meas[k].append(rep["step_seconds_median"])
        # the slowest rank's seconds in kernels (last step), and its linear rate during the run
        r = max(rep["ranks"], key=lambda x: sum(x["kernel_seconds_per_step"].values()))
        ks = r["kernel_seconds_per_step"]
        kern[k].append((sum(ks.values()), r["flops_per_step"]["linear"] / ks["linear"] * 1e-9))
print()
print("| tp x ring x ulysses | predicted s (per round) | measured s (per round) | predicted, median | "
      "measured, median | error | rank predicted | rank measured | slowest rank in kernels, its linear GFLOP/s (per round) |")
print("|---|---|---|---|---|---|---|---|---|")
P = {k: st.median(pred[k]) for k in keys}
M = {k: st.median(meas[k]) for k in keys}
bp, bm = sorted(keys, key=P.get), sorted(keys, key=M.get)
per = lambda v: " / ".join(f"{x:.2f}" for x in v)
for k in keys:
    kk = " / ".join(f"{a:.2f} s, {b:.1f}" for a, b in kern[k])
    print(f"| {k[0]} x {k[1]} x {k[2]} | {per(pred[k])} | {per(meas[k])} | {P[k]:.3f} | {M[k]:.3f} | "
          f"{100 * (P[k] - M[k]) / M[k]:+.1f}% | {bp.index(k) + 1} | {bm.index(k) + 1} | {kk} |")
print(f"\nbest predicted {bp[0]}, best measured {bm[0]}: {'same' if bp[0] == bm[0] else 'DIFFERENT'}; "
      f"largest error {max(abs(P[k] - M[k]) / M[k] for k in keys) * 100:.1f}%")
EOF
