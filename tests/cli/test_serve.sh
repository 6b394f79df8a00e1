#!/usr/bin/env bash
# test_serve.sh — `meshdit serve` end to end (docs/serve.md) with the C client
# build/tests/serve_client: info; a forward equal byte for byte to `meshdit run` on the same
# layout (and to the diffusers golden within 2e-5); a session that sends the constant tensors
# once; error replies to a malformed blob, a bad shape and an unknown op, each followed by a good
# forward (the server is alive); a client that leaves before its reply; close; SIGTERM to mpiexec
# and to rank 1 alone (every rank exits 0 within 10 s); a rank that fails inside a forward (its
# message is the client's reply within seconds);
# endpoints refused before the load. Every wait is bounded, so the test cannot hang.
set -u
BIN=${BIN:-build/meshdit}
CLIENT=${CLIENT:-build/tests/serve_client}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec.mpich || command -v mpiexec)}
DATA=${DATA:-tests/data}
CK=$DATA/flux_tiny
IN=$CK/inputs.safetensors
T=$(mktemp -d /tmp/mdt_serve_XXXXXX)
EP=ipc://$T/s.sock
SPID=
cleanup() {
    [ -n "$SPID" ] && kill -KILL "$SPID" 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
client() { timeout 60 "$CLIENT" "$EP" "$@" --timeout 30000; }
CONST=encoder_hidden_states,pooled_projections,txt_ids,img_ids

# start_server LOG [serve options]: mpiexec in the background, waits (<= 30 s) for "serving on"
start_server() {
    local log=$1; shift
    "$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$CK" --tp 2 --listen "$EP" "$@" >"$log" 2>&1 &
    SPID=$!
    for _ in $(seq 300); do
        grep -q "^serving on $EP\$" "$log" && return 0
        kill -0 "$SPID" 2>/dev/null || break
        sleep 0.1
    done
    bad "server did not start: $(cat "$log")"
    return 1
}
# stopped_within SECONDS: the server's mpiexec ended in time; STOPPED = its exit status
stopped_within() {
    local n=$(($1 * 10))
    STOPPED="still running after $1 s"
    for _ in $(seq "$n"); do
        if ! kill -0 "$SPID" 2>/dev/null; then
            wait "$SPID"; STOPPED=$?; SPID=; return 0
        fi
        sleep 0.1
    done
    return 1
}
field() { grep "^$1=" "$2" | head -1 | cut -d= -f2-; }
rank_pid() { # the pid of world rank $1 of the server (its launcher's rank variable)
    local p c
    for p in $(pgrep -P "$SPID"); do
        for c in $p $(pgrep -P "$p"); do
            tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null |
                grep -Eqx "(PMI_RANK|OMPI_COMM_WORLD_RANK)=$1" && { echo "$c"; return; }
        done
    done
}
hwm_kib() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status" 2>/dev/null; } # peak RSS of a process

# ---- endpoints refused before any weight is read (one line, exit 1) ----
refused() { # name pattern -- serve args
    local name=$1 pat=$2; shift 3
    timeout 60 "$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$CK" --tp 2 "$@" >"$T/out" 2>"$T/err"
    local rc=$?
    if [ "$rc" = 1 ] && [ "$(grep -c . "$T/err")" = 1 ] && grep -q -- "$pat" "$T/err" &&
        ! grep -q "serving on" "$T/out"; then ok; else bad "$name: exit $rc, $(cat "$T/err")"; fi
}
refused "tcp on a non-loopback address" "not a loopback address" -- --listen tcp://10.1.2.3:5555
refused "tcp on every interface" "needs --listen-any" -- --listen 'tcp://*:5555'
touch "$T/plain"
refused "ipc path that is a regular file" "exists and is not a socket" -- --listen "ipc://$T/plain"
refused "unknown scheme" "must be ipc://PATH or tcp://HOST:PORT" -- --listen inproc://x
[ -f "$T/plain" ] && ok || bad "the regular file at the ipc path was touched"
timeout 20 "$MPIEXEC" -n 1 "$BIN" serve --checkpoint "$CK" --min-rate fast >"$T/out" 2>"$T/err"
rc=$?
[ $rc = 2 ] && grep -q "^meshdit: usage error: --min-rate takes a size like .* (or 0), got 'fast'$" "$T/err" &&
    ok || bad "--min-rate fast: exit $rc, $(head -1 "$T/err")"
# --listen-any where it has no effect (an ipc socket, a loopback host) is refused, not ignored
for ep in "ipc://$T/any.sock" "tcp://127.0.0.1:5999" "tcp://127.1:5999" "tcp://LOCALHOST:5999"; do
    timeout 20 "$MPIEXEC" -n 1 "$BIN" serve --checkpoint "$CK" --listen "$ep" --listen-any >"$T/out" 2>"$T/err"
    rc=$?
    [ $rc != 0 ] && grep -q "listen-any .* where it has no effect" "$T/err" &&
        ok || bad "--listen-any with $ep: exit $rc, $(head -1 "$T/err")"
done
# a queue smaller than the largest request: such a request could only ever hear "busy"
timeout 20 "$MPIEXEC" -n 1 "$BIN" serve --checkpoint "$CK" --max-request-bytes 1G --max-queue-bytes 1K \
    >"$T/out" 2>"$T/err"
rc=$?
[ $rc = 2 ] && grep -q "^meshdit: usage error: --max-queue-bytes 1024 is less than --max-request-bytes 1073741824" "$T/err" &&
    ok || bad "--max-queue-bytes below --max-request-bytes: exit $rc, $(head -1 "$T/err")"
# a zero in any spelling of a size means no minimum (the usage error is then the next option's);
# a negative zero is not a size, nor a positive one too small for a double
for z in 0K 00 0.0MiB 0e-1G; do
    timeout 20 "$MPIEXEC" -n 1 "$BIN" serve --checkpoint "$CK" --min-rate $z --bogus 1 >"$T/out" 2>"$T/err"
    rc=$?
    [ $rc = 2 ] && grep -q "^meshdit: usage error: unknown option --bogus$" "$T/err" &&
        ok || bad "--min-rate $z: exit $rc, $(head -1 "$T/err")"
done
for z in -0 0x1p-2000 0x0 +0 0x10; do
    timeout 20 "$MPIEXEC" -n 1 "$BIN" serve --checkpoint "$CK" --min-rate $z >"$T/out" 2>"$T/err"
    rc=$?
    [ $rc = 2 ] && grep -q "^meshdit: usage error: --min-rate takes a size like .*, got '$z'$" "$T/err" &&
        ok || bad "--min-rate $z: exit $rc, $(head -1 "$T/err")"
done

# ---- one server: info, forwards, sessions, faults, close (--max-memory 3M: the tiny inputs
# fit, the 1536-token ones need 5.1 MiB per rank and are refused before the forward) ----
"$BIN" inputs --checkpoint "$CK" --img-tokens 1024 --txt-tokens 512 --out "$T/big.safetensors" >/dev/null ||
    bad "inputs for the memory check"
if start_server "$T/log" --max-memory 3M; then
    [ "$(stat -c %a "$T/s.sock")" = 600 ] && ok || bad "socket mode $(stat -c %a "$T/s.sock"), wanted 600"
    refused "ipc socket of a running server" "a running server listens there" -- --listen "$EP"

    client info >"$T/info"; rc=$?
    if [ $rc = 0 ] && [ "$(field family "$T/info")" = flux ] && [ "$(field tp "$T/info")" = 2 ] &&
        [ "$(field world "$T/info")" = 2 ] && [ "$(field dtype "$T/info")" = f32 ] &&
        field weight_bytes "$T/info" | grep -Eq '^[0-9]+,[0-9]+$' &&
        [ "$(field config_bytes "$T/info")" -gt 100 ]; then ok; else bad "info: rc $rc $(cat "$T/info")"; fi

    # a forward equals `meshdit run` on the same layout byte for byte, and the golden within 2e-5
    client forward "$IN" "$T/o.safetensors" >"$T/f0"; rc=$?
    timeout 120 "$MPIEXEC" -n 2 "$BIN" run --checkpoint "$CK" --inputs "$IN" --tp 2 \
        --out "$T/run.safetensors" --quiet
    if [ $rc = 0 ] && cmp -s "$T/o.safetensors" "$T/run.safetensors"; then ok; else
        bad "forward differs from run: rc $rc $(cat "$T/f0")"; fi
    "$BIN" compare "$T/o.safetensors" "$CK/expected.safetensors" --tol 2e-5 >/dev/null && ok ||
        bad "forward vs the diffusers golden beyond 2e-5"

    # a session: opened with "new" (the reply names its token), the constant tensors sent once,
    # then omitted; the same bytes, fewer received
    client forward "$IN" "$T/s1.safetensors" --session new --keep "$CONST" >"$T/f1"; rc1=$?
    TOK=$(field session "$T/f1")
    client forward "$IN" "$T/s2.safetensors" --session "$TOK" --omit "$CONST" >"$T/f2"; rc2=$?
    b1=$(field bytes_received "$T/f1"); b2=$(field bytes_received "$T/f2")
    if [ $rc1 = 0 ] && [ $rc2 = 0 ] && [[ $TOK =~ ^[0-9a-f]{32}$ ]] && cmp -s "$T/s1.safetensors" "$T/o.safetensors" &&
        cmp -s "$T/s2.safetensors" "$T/o.safetensors" && [ "$b2" -lt "$b1" ] &&
        [ "$(field session_bytes "$T/f2")" -gt 0 ]; then ok; else
        bad "session: rc $rc1/$rc2, token '$TOK', bytes $b1/$b2, $(cat "$T/f1" "$T/f2")"; fi
    # negative control: without the session the omitted tensors are missing
    client forward "$IN" "$T/x.safetensors" --omit "$CONST" >"$T/f3"
    grep -q "^error=.*encoder_hidden_states" "$T/f3" && ok || bad "omitted tensors without a session: $(cat "$T/f3")"
    # nothing of another client's is reachable: a name the server did not issue (as a client
    # of the old protocol would pick) is not open, even with "keep" (it used to open, overwrite
    # or end whatever session had that name); ending it touches nothing of A's
    client forward "$IN" "$T/x.safetensors" --session gen1 --keep "$CONST" >"$T/g1"
    client end_session --session gen1 >/dev/null
    client forward "$IN" "$T/g2.safetensors" --session "$TOK" --omit "$CONST" >"$T/g2"; rc=$?
    grep -q "^error=.*session 'gen1' is not open" "$T/g1" && [ $rc = 0 ] && cmp -s "$T/g2.safetensors" "$T/o.safetensors" &&
        ok || bad "sessions of other clients: $(cat "$T/g1" "$T/g2")"
    # the session ends; a forward naming it is refused
    client forward "$IN" "$T/x.safetensors" --session "$TOK" --omit "$CONST" --end-session >/dev/null &&
        ok || bad "the last forward of a session failed"
    client forward "$IN" "$T/x.safetensors" --session "$TOK" --omit "$CONST" >"$T/f4"
    grep -q "^error=.*session '$TOK' is not open" "$T/f4" && ok || bad "ended session: $(cat "$T/f4")"
    # the session count (4 open, the fifth refused)
    toks=
    for s in a b c d; do
        client forward "$IN" "$T/x.safetensors" --session new --keep txt_ids >"$T/f_$s"
        toks="$toks $(field session "$T/f_$s")"
    done
    client forward "$IN" "$T/x.safetensors" --session new --keep txt_ids >"$T/f5"
    grep -q "^error=.*a new session: 4 sessions are open.*--max-sessions 4" "$T/f5" && ok || bad "fifth session: $(cat "$T/f5")"
    for s in $toks; do client end_session --session "$s" >/dev/null || bad "end_session $s"; done

    # faults: each gets an error reply, and the server still computes the same bytes after it
    alive() { # name
        client forward "$IN" "$T/a.safetensors" >/dev/null && cmp -s "$T/a.safetensors" "$T/o.safetensors" &&
            ok || bad "$1: the server did not serve a good forward afterwards"
    }
    client raw "$CK/config.json" >"$T/e1"; rc=$?
    [ $rc = 1 ] && grep -q "^error=request: " "$T/e1" && ok || bad "malformed blob: rc $rc $(cat "$T/e1")"
    alive "malformed blob"
    client forward "$IN" "$T/x.safetensors" --truncate encoder_hidden_states >"$T/e2"; rc=$?
    [ $rc = 1 ] && grep -q "^error=.*encoder_hidden_states' has shape \[1, 48, 31\], expected \[1, 48, 32\]" "$T/e2" &&
        ok || bad "bad shape: rc $rc $(cat "$T/e2")"
    alive "bad shape"
    client forward "$T/big.safetensors" "$T/x.safetensors" >"$T/e4"; rc=$?
    [ $rc = 1 ] && grep -q "^error=.*over the --max-memory limit of 3.0 MiB" "$T/e4" && ok ||
        bad "forward over --max-memory: rc $rc $(cat "$T/e4")"
    alive "forward over --max-memory"
    client bogus >"$T/e3"; rc=$?
    [ $rc = 1 ] && grep -q "^error=request: unknown op 'bogus'" "$T/e3" && ok || bad "unknown op: rc $rc $(cat "$T/e3")"
    # a client that sends a forward and leaves before the reply; then a new client is served
    client leave "$IN" >/dev/null || bad "leaving client could not send"
    alive "client gone before its reply"

    # close: a reply, then every rank exits 0 and the socket file is gone
    client close >"$T/c"; rc=$?
    stopped_within 10; st=$STOPPED
    [ $rc = 0 ] && [ "$st" = 0 ] && [ ! -e "$T/s.sock" ] && ok || bad "close: rc $rc, server $st, $(cat "$T/log")"
fi

# ---- what rank 0 holds for a client (--max-request-bytes 4M, --max-queue-bytes 6M): the
# issue's message of 128 frames of 4 MiB - 64 B is refused as it arrives (an error reply naming
# the frames; rank 0's peak RSS grows by far less than the 512 MiB ZeroMQ buffered); a blob
# over the limit gets an error reply; 60 forwards queued by one client: at most 8 are taken,
# the others are refused at once; a good forward afterwards ----
if start_server "$T/log5" --max-request-bytes 4M --max-queue-bytes 6M --handshake-timeout 0.5 \
    --message-timeout 0.5; then
    r0=$(rank_pid 0)
    h0=$(hwm_kib "$r0")
    client frames 128 $((4 * 1048576 - 64)) >"$T/m1"; rc=$?
    h1=$(hwm_kib "$r0")
    grew=$(( (${h1:-0} - ${h0:-0}) / 1024 ))
    [ $rc = 1 ] && grep -q "^error=request: 129 frames" "$T/m1" && [ -n "$h0" ] && [ "$grew" -lt 64 ] &&
        ok || bad "128 frames: rc $rc, rank 0 peak RSS +${grew} MiB, $(cat "$T/m1")"
    client frames 1 $((5 * 1048576)) >"$T/m2"; rc=$?
    [ $rc = 1 ] && grep -q "^error=request: a blob of 5242880 bytes, over the server's --max-request-bytes 4194304" "$T/m2" &&
        ok || bad "blob over the limit: rc $rc, $(cat "$T/m2")"
    client flood 60 "$IN" >"$T/m3"; rc=$?
    nok=$(field ok "$T/m3"); nerr=$(field error "$T/m3")
    [ $rc = 0 ] && [ "$nok" -ge 1 ] && [ "$nok" -le 8 ] && [ "$nerr" = $((60 - nok)) ] &&
        grep -q "^first_error=this connection has 8 requests waiting" "$T/m3" &&
        ok || bad "60 queued forwards: rc $rc, $(cat "$T/m3")"
    client forward "$IN" "$T/m4.safetensors" >/dev/null && cmp -s "$T/m4.safetensors" "$T/o.safetensors" &&
        ok || bad "a good forward after the limits"
    # a connection that never sends its greeting is closed after --handshake-timeout 0.5 (before,
    # it kept one of the 256 places for as long as it stayed open)
    python3 - "$T/s.sock" >"$T/m5" <<'PY'
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.settimeout(5)
t0, closed = time.time(), False
try:
    while s.recv(4096):
        pass
    closed = True
except OSError:
    pass
print("closed=%d after=%.1f" % (closed, time.time() - t0))
PY
    grep -Eq "^closed=1 after=[0-2]\." "$T/m5" && ok || bad "a silent connection: $(cat "$T/m5")"
    # two clients announce 3 MiB blobs and stall after 100 bytes: a forward beside them is
    # served (before, their 6 MiB reserved up front made it "busy"), and they are closed after
    # --message-timeout 0.5
    python3 - "$T/s.sock" >"$T/m6" <<'PY' &
import socket, struct, sys, time
greeting = bytes([0xff] + [0] * 8 + [0x7f, 3, 1]) + b"NULL" + bytes(48)
ready = b"\x04\x1c\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
socks = []
for _ in range(2):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.settimeout(5)
    s.sendall(greeting + ready + b"\x01\x00" + b"\x02" + struct.pack(">Q", 3 << 20) + bytes(100))
    socks.append(s)
t0, closed = time.time(), 0
for s in socks:
    try:
        while s.recv(4096):
            pass
        closed += 1
    except OSError:
        pass
print("closed=%d after=%.1f" % (closed, time.time() - t0))
PY
    SLOW=$!
    sleep 0.2
    client forward "$IN" "$T/m7.safetensors" >"$T/m7"; rc=$?
    wait "$SLOW"
    [ $rc = 0 ] && grep -Eq "^closed=2 after=[0-2]\." "$T/m6" && ok ||
        bad "stalled 3 MiB announcements: forward rc $rc, $(cat "$T/m7" "$T/m6")"
    client close >/dev/null; stopped_within 10 || bad "close after the limits"
fi

# ---- endpoints checked before the load: a busy port and a missing directory are named even
# though the checkpoint does not exist (the load would fail next); tcp://::1:* serves ----
python3 -c 'import socket,time,sys; s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(30)' >"$T/port" &
BUSY=$!
for _ in $(seq 50); do [ -s "$T/port" ] && break; sleep 0.1; done
timeout 60 "$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$T/none" --tp 2 --listen "tcp://127.0.0.1:$(cat "$T/port")" >"$T/out" 2>"$T/err"
rc=$?
[ "$rc" = 1 ] && grep -q "cannot bind: Address already in use" "$T/err" && [ "$(grep -c . "$T/err")" = 1 ] &&
    ok || bad "busy port: exit $rc, $(cat "$T/err")"
kill "$BUSY" 2>/dev/null; wait "$BUSY" 2>/dev/null
timeout 60 "$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$T/none" --tp 2 --listen "ipc://$T/no/such/dir/s.sock" >"$T/out" 2>"$T/err"
rc=$?
[ "$rc" = 1 ] && grep -q "the directory '$T/no/such/dir' does not exist" "$T/err" && ok ||
    bad "missing directory: exit $rc, $(cat "$T/err")"
"$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$CK" --tp 2 --listen 'tcp://::1:*' >"$T/log6" 2>&1 &
SPID=$!
for _ in $(seq 300); do grep -q "^serving on " "$T/log6" && break; kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done
EP6=$(sed -n 's/^serving on //p' "$T/log6")
if [[ $EP6 =~ ^tcp://\[::1\]:[0-9]+$ ]] && timeout 60 "$CLIENT" "$EP6" info >/dev/null &&
    timeout 60 "$CLIENT" "$EP6" close >/dev/null && stopped_within 10 && [ "$STOPPED" = 0 ]; then ok; else
    bad "tcp://::1:*: '$EP6', $(cat "$T/log6")"
    kill -TERM "$SPID" 2>/dev/null; stopped_within 10
fi

# ---- two servers started at once on one ipc path: one serves, the other is refused (5 tries) ----
both=0
for i in 1 2 3 4 5; do
    EPX=ipc://$T/twice$i.sock
    "$BIN" serve --checkpoint "$CK" --listen "$EPX" >"$T/ta" 2>&1 & PA=$!
    "$BIN" serve --checkpoint "$CK" --listen "$EPX" >"$T/tb" 2>&1 & PB=$!
    for _ in $(seq 100); do
        n=$(cat "$T/ta" "$T/tb" | grep -c "^serving on ")
        { [ "$n" -ge 1 ] && { ! kill -0 "$PA" 2>/dev/null || ! kill -0 "$PB" 2>/dev/null; }; } && break
        sleep 0.1
    done
    sleep 0.3
    n=$(cat "$T/ta" "$T/tb" | grep -c "^serving on ")
    refusedn=$(cat "$T/ta" "$T/tb" | grep -c "a running server listens there")
    [ "$n" = 1 ] && [ "$refusedn" = 1 ] || both=$((both + 1))
    timeout 10 "$CLIENT" "$EPX" close >/dev/null 2>&1
    kill -TERM "$PA" "$PB" 2>/dev/null; wait "$PA" "$PB" 2>/dev/null
done
[ "$both" = 0 ] && ok || bad "two servers on one ipc path: $both of 5 tries did not end with one serving and one refused"

# ---- a repeated __metadata__ key is refused ({"op":"info","op":"close"} once closed the server),
# and so is an id that is not UTF-8 text (the reply stays valid JSON, without the id) ----
if start_server "$T/log7"; then
    python3 - "$T" <<'PY'
import json, struct, sys
t = sys.argv[1]
def blob(header):
    h = header.encode("latin-1")
    return struct.pack("<Q", len(h)) + h
open(t + "/dupop", "wb").write(blob('{"__metadata__":{"op":"info","op":"close"}}'))
open(t + "/badid", "wb").write(blob('{"__metadata__":{"op":"info","id":"x\xff\xfe"}}'))
PY
    client raw "$T/dupop" >"$T/d1"; rc=$?
    [ $rc = 1 ] && grep -q "^error=request: __metadata__ key 'op' appears twice" "$T/d1" && ok ||
        bad "repeated op: rc $rc, $(cat "$T/d1")"
    client raw "$T/badid" >"$T/d2"; rc=$?
    [ $rc = 1 ] && grep -q '^error=request: "id" must be 1 to 128 bytes of UTF-8 text' "$T/d2" &&
        ! grep -q "^id=" "$T/d2" && ok || bad "id not UTF-8: rc $rc, $(cat "$T/d2")"
    client info >/dev/null && ok || bad "the server closed on a repeated op"
    client close >/dev/null; stopped_within 10 || bad "close after the metadata checks"
fi

# ---- idle sessions expire (--session-idle 2): a session unused for 3 s is gone, one used every
# second stays ----
if start_server "$T/log11" --session-idle 2; then
    client forward "$IN" "$T/x.safetensors" --session new --keep "$CONST" >"$T/i1"; T1=$(field session "$T/i1")
    client forward "$IN" "$T/x.safetensors" --session new --keep "$CONST" >"$T/i2"; T2=$(field session "$T/i2")
    for _ in 1 2 3; do
        sleep 1
        client forward "$IN" "$T/x.safetensors" --session "$T2" --omit "$CONST" >/dev/null || bad "the session in use expired"
    done
    client forward "$IN" "$T/x.safetensors" --session "$T1" --omit "$CONST" >"$T/i3"
    grep -q "^error=.*session '$T1' is not open (ended, dropped after 2 s without use" "$T/i3" && ok ||
        bad "idle session: '$T1', $(cat "$T/i1" "$T/i3")"
    client info >"$T/i4"
    [ "$(field session_idle "$T/i4")" = 2 ] && ok || bad "info: session_idle $(field session_idle "$T/i4")"
    client close >/dev/null; stopped_within 10 || bad "close after the expiry"
fi

# ---- a loopback tcp endpoint on a free port: the port is on the "serving on" line ----
"$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$CK" --tp 2 --listen 'tcp://127.0.0.1:*' >"$T/logt" 2>&1 &
SPID=$!
for _ in $(seq 300); do grep -q "^serving on " "$T/logt" && break; kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done
TEP=$(sed -n 's/^serving on //p' "$T/logt")
if [[ $TEP =~ ^tcp://127\.0\.0\.1:[0-9]+$ ]] && timeout 60 "$CLIENT" "$TEP" info >/dev/null &&
    timeout 60 "$CLIENT" "$TEP" close >/dev/null && stopped_within 10 && [ "$STOPPED" = 0 ]; then ok; else
    bad "tcp loopback: '$TEP', $(cat "$T/logt")"
    kill -TERM "$SPID" 2>/dev/null; stopped_within 10
fi

# ---- SIGTERM to mpiexec, then to rank 1 alone: every rank exits 0 within 10 s ----
if start_server "$T/log2"; then
    client info >/dev/null || bad "info before SIGTERM"
    kill -TERM "$SPID"
    stopped_within 10; st=$STOPPED
    [ "$st" = 0 ] && ok || bad "SIGTERM to mpiexec: $st, $(cat "$T/log2")"
fi
if start_server "$T/log3"; then
    r1=$(rank_pid 1)
    if [ -n "$r1" ]; then
        kill -TERM "$r1"
        stopped_within 10; st=$STOPPED
        [ "$st" = 0 ] && ok || bad "SIGTERM to rank 1: $st, $(cat "$T/log3")"
    else
        bad "rank 1's pid not found"
    fi
fi

# ---- a rank stopped while the server is idle (--step-timeout 3): rank 1 stopped, then a
# forward: its client gets the watchdog's line as the reply and every rank exits within the
# bound (heartbeat 0.75 s + 3 s + the watchdog's 1 s grace); rank 0 stopped: the others miss
# its heartbeats and end the job; a rank stopped during the load (--load-timeout 3) ends the job
# with a line naming it. Before: each of the three hung forever ----
if start_server "$T/log8" --step-timeout 3; then
    r1=$(rank_pid 1)
    kill -STOP "$r1"
    start=$(date +%s)
    client forward "$IN" "$T/x.safetensors" >"$T/w1"; rc=$?
    stopped_within 20; st=$STOPPED
    took=$(( $(date +%s) - start ))
    [ $rc = 1 ] && grep -q "^error=step watchdog: rank 1 did not reach the .* within 3 s" "$T/w1" &&
        [ "$st" != 0 ] && [ "$took" -lt 20 ] && grep -q "^meshdit: error: step watchdog: rank 1 did not reach" "$T/log8" &&
        ok || bad "idle rank 1 stopped: rc $rc, server $st after ${took}s, $(cat "$T/w1" "$T/log8")"
    kill -KILL "$r1" 2>/dev/null
fi
if start_server "$T/log9" --step-timeout 3; then
    r0=$(rank_pid 0)
    kill -STOP "$r0"
    start=$(date +%s)
    stopped_within 20; st=$STOPPED
    took=$(( $(date +%s) - start ))
    [ "$st" != 0 ] && [ "$took" -lt 20 ] &&
        grep -q "^meshdit: error: step watchdog: rank 0 did not reach the request header within" "$T/log9" &&
        ok || bad "idle rank 0 stopped: server $st after ${took}s, $(cat "$T/log9")"
    kill -KILL "$r0" 2>/dev/null
fi
start=$(date +%s)
MESHDIT_TEST_FAIL=load:1:stop timeout -k 5 40 "$MPIEXEC" -n 2 "$BIN" serve --checkpoint "$CK" --tp 2 --listen "$EP" --load-timeout 3 >"$T/log10" 2>&1
rc=$?; took=$(( $(date +%s) - start ))
[ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$took" -lt 20 ] &&
    grep -q "^meshdit: error: step watchdog: rank 1 did not reach the failure agreement within 3 s .*--load-timeout sets the bound" "$T/log10" &&
    ! grep -q "^serving on" "$T/log10" && ok || bad "rank 1 stopped in the load: exit $rc after ${took}s, $(cat "$T/log10")"

# ---- memory: without --max-memory every forward is checked as `run` checks its inputs, against
# what the node has (MESHDIT_MEM_AVAILABLE=64M replaces that figure: 32 MiB for each of the two
# ranks): a 40k-token forward is refused before it runs, the tiny one still served. Before, only
# --max-memory was checked and the forward ran ----
"$BIN" inputs --checkpoint "$CK" --img-tokens 40000 --txt-tokens 512 --out "$T/huge.safetensors" >/dev/null ||
    bad "inputs for the default memory check"
if MESHDIT_MEM_AVAILABLE=64M start_server "$T/log12"; then
    start=$(date +%s)
    client forward "$T/huge.safetensors" "$T/x.safetensors" >"$T/mm1"; rc=$?
    took=$(( $(date +%s) - start ))
    [ $rc = 1 ] && [ "$took" -lt 5 ] &&
        grep -q "^error=rank 0: tp=2 needs .* over the 32.0 MiB this rank may use (MESHDIT_MEM_AVAILABLE: 64.0 MiB for the 2 ranks on this node" "$T/mm1" &&
        ok || bad "default memory check: rc $rc after ${took}s, $(cat "$T/mm1")"
    alive "the default memory check"
    client close >/dev/null; stopped_within 10 || bad "close after the memory check"
fi

# ---- SIGTERM while a forward runs (60k tokens: half a minute of compute): on mpiexec, every
# rank's next wait ends the forward, the client's reply says so within seconds and the job ends;
# one rank (no collective to stop at): the request gets 5 s, then the reply and the exit. Before,
# the forward ran to its end and only SIGKILL ended it sooner. A request queued behind the
# forward gets the same line, and each reply names its request's id (before, on one rank
# neither reply carried an id; on two, the queued one's did not) ----
"$BIN" inputs --checkpoint "$CK" --img-tokens 60000 --txt-tokens 512 --out "$T/long.safetensors" >/dev/null ||
    bad "inputs for the long forward"
if start_server "$T/log13"; then
    client forward "$T/long.safetensors" "$T/x.safetensors" --id long1 >"$T/st1" & CL=$!
    sleep 1
    client info --id q1 >"$T/sq1" & CQ=$!
    sleep 1
    start=$(date +%s)
    kill -TERM "$SPID"
    wait "$CL"; rc=$?
    wait "$CQ"; rcq=$?
    took=$(( $(date +%s) - start ))
    stopped_within 10; st=$STOPPED
    [ $rc = 1 ] && [ "$took" -lt 8 ] && grep -q "^error=.*stopped by a signal (SIGTERM or SIGINT)" "$T/st1" &&
        [ "$st" != "still running after 10 s" ] && ok ||
        bad "SIGTERM during a forward: rc $rc after ${took}s, server $st, $(cat "$T/st1" "$T/log13")"
    [ $rcq = 1 ] && grep -q "^id=q1$" "$T/sq1" && grep -q "^error=.*stopped by a signal" "$T/sq1" && ok ||
        bad "a request queued behind a forward stopped by SIGTERM: rc $rcq, $(cat "$T/sq1")"
fi
"$BIN" serve --checkpoint "$CK" --listen "$EP" >"$T/log14" 2>&1 &
SPID=$!
for _ in $(seq 300); do grep -q "^serving on" "$T/log14" && break; sleep 0.1; done
client forward "$T/long.safetensors" "$T/x.safetensors" --id long2 >"$T/st2" & CL=$!
sleep 1
client info --id q2 >"$T/sq2" & CQ=$!
sleep 1
start=$(date +%s)
kill -TERM "$SPID"
wait "$CL"; rc=$?
wait "$CQ"; rcq=$?
took=$(( $(date +%s) - start ))
stopped_within 10; st=$STOPPED
[ $rc = 1 ] && [ "$took" -lt 9 ] && grep -q "^error=stopped by a signal .* did not end within 5 s" "$T/st2" &&
    grep -q "^id=long2$" "$T/st2" && [ "$st" = 1 ] && [ ! -e "$T/s.sock" ] && ok ||
    bad "SIGTERM during a one-rank forward: rc $rc after ${took}s, server $st, $(cat "$T/st2" "$T/log14")"
[ $rcq = 1 ] && grep -q "^id=q2$" "$T/sq2" && grep -q "^error=stopped by a signal" "$T/sq2" && ok ||
    bad "a request queued behind a one-rank forward stopped by SIGTERM: rc $rcq, $(cat "$T/sq2")"

# ---- one rank, SIGTERM while a forward of about 2 s runs (within the 5 s grace) with a request
# queued behind it: the forward answers, the queued request gets the stop's error with its id
# and the server exits. Before, the queued request's connection was just closed (no reply) ----
"$BIN" inputs --checkpoint "$CK" --img-tokens 20000 --txt-tokens 512 --out "$T/mid.safetensors" >/dev/null ||
    bad "inputs for the 2 s forward"
"$BIN" serve --checkpoint "$CK" --listen "$EP" >"$T/log15" 2>&1 &
SPID=$!
for _ in $(seq 300); do grep -q "^serving on" "$T/log15" && break; sleep 0.1; done
client forward "$T/mid.safetensors" "$T/x.safetensors" --id mid >"$T/sm1" & CL=$!
sleep 0.5
timeout 60 "$CLIENT" "$EP" info --id q3 --timeout 10000 >"$T/sm2" & CQ=$!
sleep 0.3
kill -TERM "$SPID"
wait "$CL"
wait "$CQ"; rcq=$?
stopped_within 10; st=$STOPPED
[ $rcq = 1 ] && grep -q "^id=q3$" "$T/sm2" && grep -q "^error=stopped by a signal (SIGTERM or SIGINT)" "$T/sm2" &&
    [ "$st" != "still running after 10 s" ] && ok ||
    bad "a request queued behind a forward that ended within the grace: rc $rcq, server $st, $(cat "$T/sm2" "$T/log15")"
# the same behind a close: the close is answered, the request queued after it gets why
"$BIN" serve --checkpoint "$CK" --listen "$EP" >"$T/log16" 2>&1 &
SPID=$!
for _ in $(seq 300); do grep -q "^serving on" "$T/log16" && break; sleep 0.1; done
client forward "$T/mid.safetensors" "$T/x.safetensors" >/dev/null & CL=$!
sleep 0.5
client close >"$T/sc1" & CC=$!
sleep 0.2
timeout 60 "$CLIENT" "$EP" info --id q4 --timeout 10000 >"$T/sc2" & CQ=$!
wait "$CL"; wait "$CC"; rcc=$?
wait "$CQ"; rcq=$?
stopped_within 10; st=$STOPPED
[ $rcc = 0 ] && [ $rcq = 1 ] && grep -q "^id=q4$" "$T/sc2" &&
    grep -q "^error=the server was closed (a close request) before this request ran" "$T/sc2" && [ "$st" = 0 ] && ok ||
    bad "a request queued behind a close: rc $rcc/$rcq, server $st, $(cat "$T/sc1" "$T/sc2" "$T/log16")"

# ---- a rank that fails inside a forward (default bounds: step watchdog >= 60 s, agreement
# 20 s): the failed rank's note reaches rank 0 in its collective at once, the waiting client
# gets "rank 1: ..." as its reply, and the job ends with that one line and exit 1 ----
if MESHDIT_TEST_FAIL=step:1 start_server "$T/log4"; then
    start=$(date +%s)
    client forward "$IN" "$T/x.safetensors" >"$T/f6"; rc=$?
    stopped_within 15; st=$STOPPED
    took=$(( $(date +%s) - start ))
    [ $rc = 1 ] && grep -q "^error=rank 1: injected failure during step" "$T/f6" && [ "$st" != 0 ] &&
        [ "$took" -lt 15 ] &&
        [ "$(grep -c "^meshdit: error: rank 1: injected failure" "$T/log4")" = 1 ] &&
        [ "$(grep -c "^meshdit: error: " "$T/log4")" = 1 ] && ok ||
        bad "failing rank: rc $rc, server $st after ${took}s, $(cat "$T/f6" "$T/log4")"
fi

echo "serve: $pass passed, $fail failed"
[ "$fail" = 0 ]
