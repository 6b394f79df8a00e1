#!/usr/bin/env bash
# cluster_cfg.sh — the cfg axis across hosts (issue 29): a guided `meshdit run --steps N` of a Wan
# transformer with cfg 2 over two namespace hosts (scripts/netns-cluster, shaped links, Open MPI
# over TCP: every byte between the hosts crosses a veth link), against one rank on one host, and
# against the two-host tp2 / ulysses2 / ring2 layouts; rounds alternate, medians of the report's
# step_seconds_median (a step: both branches and their combination). Needs root and Open MPI
# (scripts/install-deps); never part of `make test`.
#
# usage: bench/cluster_cfg.sh [--rate 1gbit] [--rounds 3] [--steps 4] [--layers 16]
#                             [--img 1024] [--txt 256]
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=1gbit ROUNDS=3 STEPS=4 LAYERS=16 IMG=1024 TXT=256
while [ $# -gt 0 ]; do
    case "$1" in
    --rate) RATE=$2; shift 2 ;; --rounds) ROUNDS=$2; shift 2 ;; --steps) STEPS=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;; --img) IMG=$2; shift 2 ;; --txt) TXT=$2; shift 2 ;;
    *) echo "usage: see the header of $0" >&2; exit 2 ;;
    esac
done
. bench/cluster_setup.sh # env, builds, $C, $BIN, $T, the cluster down on exit
$C up 2 --rate "$RATE" >/dev/null
H1=$($C hosts 1 | cut -d, -f1) H2=$($C hosts 1)
build/meshdit gen --model wan --preset tiny --out "$T/tiny" >/dev/null
python3 - "$T/tiny/config.json" "$T/cfg.json" "$LAYERS" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(num_attention_heads=8, attention_head_dim=128, ffn_dim=4096, num_layers=int(sys.argv[3]))
json.dump(c, open(sys.argv[2], "w"))
PY
build/meshdit gen --model wan --config "$T/cfg.json" --seed 1 --out "$T/ck" >/dev/null
build/meshdit inputs --checkpoint "$T/ck" --negative --img-tokens "$IMG" --txt-tokens "$TXT" \
    --seed 2 --out "$T/in.safetensors" >/dev/null
run() { # NAME HOSTS N ARGS...: one run, its report's median step appended to $T/NAME
    local name=$1 hosts=$2 n=$3
    shift 3
    timeout 900 $C mpirun --host "$hosts" -n "$n" -x OPENBLAS_NUM_THREADS=1 $BIN run \
        --checkpoint "$T/ck" --inputs "$T/in.safetensors" --steps "$STEPS" --guidance-scale 5 \
        --out "$T/out.$name" --report "$T/rep" --quiet "$@" </dev/null
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["step_seconds_median"])' \
        "$T/rep" >>"$T/$name"
}
for _ in $(seq "$ROUNDS"); do
    run one "$H1" 1
    run cfg2 "$H2" 2 --cfg 2
    run tp2 "$H2" 2 --tp 2
    run ulysses2 "$H2" 2 --ulysses 2
    run ring2 "$H2" 2 --ring 2
done
build/meshdit compare "$T/out.cfg2" "$T/out.one" --tol 1e-5 >/dev/null ||
    echo "warning: cfg2 across hosts differs from one rank beyond 1e-5"
echo "wan: $LAYERS blocks of 1024 (ffn 4096), $IMG image + $TXT text tokens, guidance 5, $STEPS steps; links $RATE; median of $ROUNDS alternating rounds"
python3 - "$T" <<'PY'
import statistics as st, sys
T = sys.argv[1]
m = {k: st.median(float(x) for x in open(f"{T}/{k}")) for k in ("one", "cfg2", "tp2", "ulysses2", "ring2")}
print("| layout | s per step (both branches) | vs one rank on one host |")
print("|---|---|---|")
for k, v in m.items():
    print(f"| {'1 rank, 1 host' if k == 'one' else k + ' across 2 hosts'} | {v:.3f} | {m['one'] / v:.2f}x |")
PY
