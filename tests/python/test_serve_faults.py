"""The Python package and `meshdit serve` under the faults of issues 26 and 27: the job follows
the process that started it (not its thread; every way it dies), a rank stopped while the
server idles, a dead server seen by a client that only connected (and its stale socket file),
and the MPI job's sockets on loopback. Each test failed before its fix."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.numpy import load_file

import meshdit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLUX = os.path.join(ROOT, "tests", "data", "flux_tiny")
INPUTS = os.path.join(FLUX, "inputs.safetensors")


def tensors():
    return {k: torch.from_numpy(v) for k, v in load_file(INPUTS).items()}


def children(pid):
    """Every descendant of `pid` (the launcher's proxies and ranks)."""
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def rank_pid(server, rank):
    for p in children(server.proc.pid):
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"PMI_RANK={rank}".encode() in f.read().split(b"\0"):
                    return p
        except OSError:
            pass
    raise AssertionError(f"rank {rank} of the server not found")


def gone_within(pids, seconds):
    """True when none of `pids` runs (zombies count as gone) within `seconds`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        alive = []
        for p in pids:
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(p)
            except OSError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


# ---- the job follows its owner process (issue 27, items 4 and 6) ------------------------------
def test_a_server_made_in_a_thread_outlives_the_thread():
    """A loader thread (as Gradio or FastAPI runs one) starts the server and ends: the server
    keeps serving. Before, PR_SET_PDEATHSIG ended it with the thread ("the server exited with
    status 0: serving on ...")."""
    made = {}
    th = threading.Thread(target=lambda: made.setdefault("t", meshdit.Transformer.from_pretrained(FLUX, tp=2)))
    th.start()
    th.join()
    t = made["t"]
    try:
        time.sleep(1.5)
        assert t._server.proc.poll() is None, t._server.log()
        assert t(**tensors()).sample.isfinite().all()
    finally:
        t.close()


OWNER = ("import meshdit, sys, time; s = meshdit.Server(sys.argv[1], tp=2, max_sessions=%d); "
         "print(s.proc.pid, flush=True); time.sleep(600)")


@pytest.mark.parametrize("sig", ["TERM", "KILL"])
def test_an_owner_ended_by_timeout_takes_its_server_along(sig):
    """`timeout -s TERM|KILL` ends the Python process that started a server: every process of
    the job ends within seconds. Before, the server was left running, its parent init."""
    tag = 40 + (sig == "KILL")  # the launch's own command line, to find its processes
    py = subprocess.Popen(["timeout", "-s", sig, "4", sys.executable, "-c", OWNER % tag, FLUX],
                          stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    pid = int(py.stdout.readline())
    job = children(pid)
    py.wait(timeout=30)
    ok = gone_within(job, 20)
    if not ok:
        for p in job:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    assert ok, "the job outlived the process that started it"


def test_an_unexpected_exit_says_what_happened():
    """Someone else stops the job: the next call says by which signal and from which process,
    not the 'serving on' line."""
    srv = meshdit.Server(FLUX, tp=2)
    try:
        os.killpg(srv.proc.pid, signal.SIGTERM)
        srv.proc.wait(timeout=20)
        with pytest.raises(meshdit.MeshditError,
                           match=r"exited with status 0: meshdit: serve: stopped by SIGTERM from process \d+"):
            srv.client.info()
    finally:
        srv.close()


# ---- a rank stopped while the server idles (issue 26, item 1) ---------------------------------
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_stopped_while_idle_ends_the_wait(rank):
    """SIGSTOP of rank 1 (or rank 0) between requests, then a forward: it fails within the
    bound (step_timeout=3) with the watchdog's line. Before, the client hung."""
    t = meshdit.Transformer.from_pretrained(FLUX, tp=2, step_timeout=3)
    try:
        os.kill(rank_pid(t._server, rank), signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(meshdit.MeshditError, match=f"step watchdog: rank {rank} did not reach"):
            t(**tensors())
        assert time.monotonic() - t0 < 20
        assert t._server.proc.wait(timeout=20) not in (None, 0)
    finally:
        t.close()


# ---- a dead server, seen by a client that only connected (issue 26, item 8) -------------------
def test_a_connect_client_notices_a_killed_server(tmp_path):
    """Rank 1 is killed mid-forward; the launcher ends the job at once. A client that only
    connected (its own timeout 60 s) gets an error within seconds, and the socket file left
    behind is removed. Before, it waited its whole timeout (600 s by default)."""
    ep = f"ipc://{tmp_path}/s.sock"
    srv = meshdit.Server(FLUX, tp=2, endpoint=ep, env=dict(os.environ, MESHDIT_TEST_FAIL="step:1:kill"))
    try:
        with meshdit.Transformer.connect(ep, timeout=60) as t:
            t0 = time.monotonic()
            with pytest.raises(meshdit.MeshditError, match="closed while this request was pending"):
                t(**tensors())
            assert time.monotonic() - t0 < 8
        srv.proc.wait(timeout=20)
        assert not os.path.exists(f"{tmp_path}/s.sock")
    finally:
        srv.close()


def test_a_connect_client_notices_a_stopped_server(tmp_path):
    """Rank 0 stopped (SIGSTOP) while a connected client waits: its heartbeats go unanswered and
    the wait ends within seconds (the server's own watchdog is at its default 60 s)."""
    srv = meshdit.Server(FLUX, tp=2)
    try:
        with meshdit.Transformer.connect(srv.endpoint, timeout=60) as t:
            t(**tensors())
            r0 = rank_pid(srv, 0)
            os.kill(r0, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(meshdit.MeshditError, match="stopped answering heartbeats|no server answered"):
                t(**tensors())
            assert time.monotonic() - t0 < 12
            os.kill(r0, signal.SIGCONT)
    finally:
        srv.close()


def test_a_stale_socket_file_is_removed_by_a_client(tmp_path):
    """A socket file that nobody listens on (its server was killed): a client says so at once and
    removes it; a live server's file is left alone."""
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()  # the file stays, nobody listens
    t0 = time.monotonic()
    with pytest.raises(meshdit.MeshditError, match="nobody listens there any more.*removed"):
        meshdit.Client("ipc://" + path, timeout=30)
    assert time.monotonic() - t0 < 3 and not os.path.exists(path)
    srv = meshdit.Server(FLUX)
    try:
        from meshdit.client import remove_stale_socket
        assert not remove_stale_socket(srv.endpoint[len("ipc://"):])
        assert srv.client.info()["status"] == "ok"
    finally:
        srv.close()


# ---- the MPI job's sockets stay on loopback (issue 26, item 4) --------------------------------
def listening(pids):
    """(protocol, address, port) of every TCP/UDP socket that processes `pids` listen on."""
    inodes = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    out = []
    for name, v6, state in (("tcp", False, "0A"), ("tcp6", True, "0A"), ("udp", False, "07"),
                            ("udp6", True, "07")):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                x = line.split()
                if x[3] != state or x[9] not in inodes:
                    continue
                addr, port = x[1].split(":")
                raw = bytes.fromhex(addr)
                if v6:  # four little-endian words
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    host = socket.inet_ntop(socket.AF_INET6, raw)
                else:
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                out.append((name, host, int(port, 16)))
    return out


def is_loopback(host):
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def test_the_mpi_job_listens_on_loopback_only():
    """A one-host job started by the package: no process of it (mpiexec, hydra's proxy, the
    ranks) listens outside loopback. Before, hydra's PMI port was on 0.0.0.0 and every rank had
    a port on the machine's external address. With loopback=False (the negative control) they
    are back, on a machine that has an external address."""
    with meshdit.Server(FLUX, tp=2) as srv:
        socks = listening(children(srv.proc.pid))
        assert socks and all(is_loopback(h) for _, h, _ in socks), socks
        assert srv.client.info()["world"] == "2"
    with meshdit.Server(FLUX, tp=2, loopback=False) as srv:
        socks = listening(children(srv.proc.pid))
    if not any(not is_loopback(h) for _, h, _ in socks):
        pytest.skip("no socket off loopback even without the loopback launch (no external address?)")
