#!/usr/bin/env bash
# test_cluster.sh — meshdit across hosts (make test-cluster): two network-namespace hosts on one
# machine (scripts/netns-cluster), ranks launched into them by Open MPI over TCP only, layouts
# that span the hosts equal to the single-rank run, each rank's host and node-local rank right,
# the bytes between hosts really crossing the links, and a host whose link is cut mid-run ending
# the job with one line within a bounded time. Needs root, iproute2 and Open MPI (install-deps);
# where any is missing it says why and skips (exit 0), never silently.
set -uo pipefail
cd "$(dirname "$0")/../.."
skip() { echo "test-cluster: SKIPPED: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces)"
command -v ip >/dev/null && command -v unshare >/dev/null && command -v tc >/dev/null ||
    skip "needs iproute2 (ip, tc) and unshare"
command -v mpirun.openmpi >/dev/null || skip "needs Open MPI (mpirun.openmpi; scripts/install-deps)"
ip netns add mdt-probe 2>/dev/null || skip "this machine does not allow network namespaces"
ip netns del mdt-probe
make -s MPI_PKG=ompi BUILD=build-ompi build-ompi/meshdit >/dev/null || {
    echo "test-cluster: FAILED: cannot build meshdit against Open MPI"; exit 1; }

C=scripts/netns-cluster
BIN=build-ompi/meshdit
T=$(mktemp -d)
trap '$C down >/dev/null 2>&1; rm -rf "$T"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "  FAIL: $*"; }
export OPENBLAS_NUM_THREADS=1

# The links between hosts shaped to 1 Gbit/s (a token bucket; latency needs netem, which not
# every kernel has): traffic between hosts pays it, ranks of one host use their loopback.
$C up 2 --rate 1gbit >/dev/null || { echo "test-cluster: FAILED: netns-cluster up"; exit 1; }
hosts1=$($C hosts 1) hosts2=$($C hosts 2)

LAYOUTS=("2 1 --ring 2|ring across hosts"
         "2 1 --ulysses 2|ulysses across hosts"
         "2 1 --tp 2|tp across hosts"
         "4 2 --tp 2 --ring 2 --mesh-order ring,ulysses,tp|tp inside, ring across"
         "4 2 --tp 2 --ring 2 --mesh-order tp,ring,ulysses|ring inside, tp across"
         "4 2 --ring 2 --ulysses 2|ulysses inside, ring across"
         "4 2 --tp 2 --ulysses 2 --mesh-order ulysses,ring,tp|tp inside, ulysses across")
for fam in flux wan; do
    ck=$T/$fam
    build/meshdit gen --model $fam --preset tiny --seed 5 --out "$ck" >/dev/null &&
        build/meshdit inputs --checkpoint "$ck" --seed 6 --out "$ck.in" >/dev/null &&
        build/meshdit run --checkpoint "$ck" --inputs "$ck.in" --out "$ck.ref" --quiet ||
        { bad "$fam: single-rank reference"; continue; }
    # "N SLOTS LAYOUT|what spans the hosts"; with 2 slots per host ranks 0, 1 are host 0's
    for line in "${LAYOUTS[@]}"; do
        spec=${line%%|*} what=${line#*|}
        read -r n hl layout <<<"$spec"
        h=$hosts1; [ "$hl" = 2 ] && h=$hosts2
        tag="$fam n=$n $layout"
        rm -f "$T/out" "$T/rep"
        if ! timeout 120 $C mpirun --host "$h" -n "$n" -x OPENBLAS_NUM_THREADS=1 $BIN run \
            --checkpoint "$ck" --inputs "$ck.in" $layout --out "$T/out" --report "$T/rep" \
            --quiet >"$T/log" 2>&1 </dev/null; then
            bad "$tag ($what): $(grep -m1 'meshdit: error' "$T/log" || tail -1 "$T/log")"; continue
        fi
        if build/meshdit compare "$T/out" "$ck.ref" --tol 1e-5 >"$T/cmp"; then ok
        else bad "$tag ($what): $(tail -1 "$T/cmp")"; fi
        # placement: world rank k sits on host k / slots with node-local rank k % slots, and the
        # layout spans the hosts as claimed (coordinates of the two ranks of host 0)
        python3 - "$T/rep" "$n" "$hl" "$what" >"$T/py" 2>&1 <<'EOF' && ok || bad "$tag: $(cat "$T/py")"
import json, sys
rep, n, slots, what = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ranks = sorted(rep["ranks"], key=lambda r: r["rank"])
assert len(ranks) == n, f"{len(ranks)} ranks in the report"
for r in ranks:
    k, node = r["rank"], r["node"]
    want = (f"mdt-h{k // slots}", k % slots, slots)
    assert (node["host"], node["rank"], node["ranks"]) == want, f"rank {k}: node {node}, expected {want}"
if slots == 2:  # the axis whose coordinate differs between the two ranks of host 0 stays inside it
    a, b = ranks[0]["coords"], ranks[1]["coords"]
    inside = [ax for ax in ("tp", "ring", "ulysses") if a[ax] != b[ax]]
    assert inside == [what.split()[0]], f"inside host 0: {inside}, expected {what.split()[0]}"
EOF
        # every axis that spans the hosts moved its bytes over the veth links, not shared memory
        sent=$(python3 -c "
import json; r = json.load(open('$T/rep'))
print(sum(sum(x['bytes_sent_per_step_by_axis'].values()) for x in r['ranks']))")
        [ "$sent" -gt 0 ] || bad "$tag: the report says no bytes moved"
    done
done

# The bytes between the hosts crossed host 1's link: its counters grew by at least what the
# ring exchange of a 2-host run reports (no shared-memory shortcut between namespaces).
ck=$T/flux
b0=$(ip netns exec mdt-h1 cat /sys/class/net/eth0/statistics/tx_bytes)
timeout 120 $C mpirun --host "$hosts1" -n 2 -x OPENBLAS_NUM_THREADS=1 $BIN run --checkpoint "$ck" \
    --inputs "$ck.in" --ring 2 --repeat 3 --out "$T/out" --report "$T/rep" --quiet >"$T/log" 2>&1 ||
    bad "link counters: run failed: $(tail -1 "$T/log")"
b1=$(ip netns exec mdt-h1 cat /sys/class/net/eth0/statistics/tx_bytes)
r1=$(python3 -c "
import json; r = json.load(open('$T/rep'))
print(sum(x['bytes_sent_per_step_by_axis']['ring'] for x in r['ranks'] if x['rank'] == 1))")
if [ "$r1" -gt 0 ] && [ $((b1 - b0)) -ge "$r1" ]; then ok
else bad "host 1 sent $((b1 - b0)) bytes on its link, its rank reports $r1 ring bytes per step"; fi

# Calibration across the cluster: 2 hosts x 2 ranks measure every collective inside a host and
# across the shaped link; the link's all-to-all bandwidth is what the 1 Gbit/s token bucket lets
# through (at most 125 MB/s, and far below the unshaped in-host one); the plan reads the file.
if timeout 300 $C mpirun --host "$hosts2" -n 4 -x OPENBLAS_NUM_THREADS=1 $BIN plan --checkpoint "$ck" \
        --calibrate "$T/dev.json" --tokens 256 >"$T/cal" 2>&1 &&
   [ "$(grep -c 'inside a host: ' "$T/cal")" = 4 ] && [ "$(grep -c 'across hosts: ' "$T/cal")" = 4 ] &&
   python3 - "$T/dev.json" >"$T/py" 2>&1 <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
inter, intra = d["collectives"]["inter"]["alltoall"], d["collectives"]["intra"]["alltoall"]
assert d["calibrated"] is True and d["devices_per_node"] == 2, d
assert 10e6 < inter["bytes_per_s"] < 130e6, f"across the 1 Gbit/s link: {inter}"
assert intra["bytes_per_s"] > 2 * inter["bytes_per_s"], f"inside {intra}, across {inter}"
EOF
then
    if build/meshdit plan --checkpoint "$ck" --device-file "$T/dev.json" --devices 4 --tokens 256 \
        >"$T/plan" && grep -q "(calibrated)" "$T/plan" && grep -q "<- best" "$T/plan"; then ok
    else bad "plan --device-file: $(head -3 "$T/plan")"; fi
else
    bad "calibrate across hosts: $(cat "$T/py" 2>/dev/null) $(head -c 800 "$T/cal")"
fi

# A host that disappears: host 1's link is cut mid-run; the job ends within the bound
# (--step-timeout 3 + the launcher noticing the lost daemon) with meshdit's one line naming the
# rank, a failing exit status, and no rank left running on any host.
build/meshdit gen --model flux --preset medium --out "$T/med" >/dev/null
build/meshdit inputs --checkpoint "$T/med" --img-tokens 256 --txt-tokens 64 --out "$T/med.in" >/dev/null
t0=$(date +%s.%N)
timeout 120 $C mpirun --host "$hosts1" -n 2 -x OPENBLAS_NUM_THREADS=1 $BIN run --checkpoint "$T/med" \
    --inputs "$T/med.in" --ring 2 --repeat 400 --step-timeout 3 --out "$T/cut.out" --quiet \
    >"$T/cut.log" 2>&1 &
job=$!
sleep 3
$C cut 1
wait $job
rc=$?
el=$(python3 -c "import time; print(f'{time.time() - $t0 - 3:.1f}')")
left=$(pgrep -fc "$BIN run" || true)
if [ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -q "meshdit: error: step watchdog: rank 1 " "$T/cut.log" &&
    [ ! -e "$T/cut.out" ] && [ "$left" = 0 ] && python3 -c "import sys; sys.exit(float('$el') > 30)"; then
    ok
    echo "  link cut: the job ended ${el} s after the cut (rc $rc): $(grep -m1 'meshdit: error' "$T/cut.log")"
else
    bad "link cut: rc $rc after ${el} s, $left ranks left, output $([ -e "$T/cut.out" ] && echo written || echo none): $(grep -m1 'meshdit: error' "$T/cut.log" || tail -2 "$T/cut.log")"
fi

echo "tests/cluster/test_cluster.sh: $pass passed, $fail failed"
[ "$fail" = 0 ]
