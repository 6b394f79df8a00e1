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
