"""A client of `meshdit serve`: one ZeroMQ connection, requests and replies as blobs.

The protocol is docs/serve.md. The socket is a DEALER (the server's is a ROUTER): every request
carries an ``id`` and a reply with another id (a late reply to a request that timed out) is
dropped, so a timeout never leaves the connection out of step the way a REQ socket would be.

A dead server is noticed within seconds, not at the end of the timeout: the socket runs ZeroMQ
heartbeats (the server answers them, also while a forward computes) and a monitor of its
connection, so a request pending when the connection closes — the server exited, was killed,
or stopped answering heartbeats — fails at once. A socket file nobody listens on any more is
removed (under the same lock on its directory that a server takes to bind it).

Sessions are named here by the caller's own handles; the server issues each one a token when it
opens (``"session": "new"``), which this client keeps and sends for that handle from then on.
Error messages name the handle, not the token.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import os
import socket
import stat
import threading
import time
from typing import Callable, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import _blob


class MeshditError(RuntimeError):
    """A request failed: the server's one-line error, or no reply in time, or the server ended."""


class ServerError(MeshditError):
    """The server answered with an error reply; `.error` is its one line, `.metadata` the rest."""

    def __init__(self, op: str, error: str, metadata: Mapping[str, str]):
        super().__init__(f"meshdit serve: {op}: {error}")
        self.op, self.error, self.metadata = op, error, dict(metadata)


_ids = itertools.count(1)
HEARTBEAT_MS = 1000  # a ping this often; the connection is dropped after 4 without an answer
CONNECT_GRACE_S = 5.0  # a request sent while not connected waits this long for a connection


def remove_stale_socket(path: str) -> bool:
    """Removes `path` if it is a Unix socket nobody listens on (a server that was killed left it),
    under an exclusive lock on its directory, the lock a server holds while it checks and binds
    that path (so a server that is just starting there is never touched). True when removed."""
    try:
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(1.0)
            s.connect(path)
            return False  # a live server
        except OSError as e:
            if e.errno != errno.ECONNREFUSED:
                return False
            os.unlink(path)
            return True
        finally:
            s.close()
    finally:
        os.close(dfd)  # releases the lock


class Client:
    """One connection to a server at `endpoint` (``ipc://PATH`` or ``tcp://HOST:PORT``).

    timeout: seconds to wait for a reply (None: no bound). alive: called every 100 ms while
    waiting; it returns None while the server can still answer, or a message that ends the wait
    with a MeshditError (the launcher's check that its server process is still running).
    """

    def __init__(self, endpoint: str, timeout: float | None = 600.0,
                 alive: Callable[[], str | None] | None = None):
        self.endpoint, self.timeout, self._alive = endpoint, timeout, alive
        if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://")):
            raise MeshditError(f"meshdit: endpoint {endpoint!r} is neither ipc://PATH nor "
                               f"tcp://HOST:PORT")
        if endpoint.startswith("ipc://"):
            # ZeroMQ would wait for a socket file to appear: say at once that there is no server
            path = endpoint[len("ipc://"):]
            try:
                is_sock = stat.S_ISSOCK(os.stat(path).st_mode)
            except OSError as e:
                raise MeshditError(f"meshdit: no server at {endpoint}: {e.strerror}") from None
            if not is_sock:
                raise MeshditError(f"meshdit: no server at {endpoint}: '{path}' is not a socket")
            if remove_stale_socket(path):
                raise MeshditError(f"meshdit: no server at {endpoint}: nobody listens there any "
                                   f"more (the socket file of a server that ended; removed)")
        self._lock = threading.Lock()  # one request at a time over the one socket
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4 * HEARTBEAT_MS)
        if endpoint.startswith("tcp://[") or endpoint.count(":") > 2:
            self._sock.setsockopt(zmq.IPV6, 1)
        # the connection's events: a request pending when it closes fails at once
        self._mon = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED |
                                                  zmq.EVENT_DISCONNECTED)
        self._connected = False
        self._lost = False  # the connection closed since the last request was sent
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._sock.disable_monitor()
            self._mon.close(0)
            self._sock.close(0)
            self._sock = None
            raise MeshditError(f"meshdit: cannot connect to {endpoint}: {e}") from None
        self.bytes_sent = 0  # request bytes over the connection's life
        self.bytes_received = 0
        self._tokens: dict[str, str] = {}  # the caller's session handle -> the server's token
        # the server's --max-request-bytes (from info): ZeroMQ drops a larger message without a
        # reply, so such a request is refused here instead of waiting for nothing
        self.max_request_bytes: int | None = None

    # -- requests -------------------------------------------------------------------------------
    def request(self, metadata: Mapping[str, str], tensors: Mapping[str, _blob.Raw] | None = None,
                timeout: float | None = -1.0) -> tuple[dict, dict]:
        """Sends one request and waits for its reply: (metadata, {name: numpy array}).

        Raises ServerError for an error reply, MeshditError when no reply comes in time or the
        server ended. timeout -1 means the client's default. Thread-safe: requests from several
        threads take turns.
        """
        with self._lock:
            return self._request(metadata, tensors, timeout)

    def _request(self, metadata, tensors, timeout):
        if self._sock is None:
            raise MeshditError("meshdit: the client is closed")
        op = str(metadata.get("op", "?"))
        rid = f"py{os.getpid()}-{next(_ids)}"
        parts = _blob.encode({**metadata, "id": rid}, tensors)
        body = b"".join(parts)
        if self.max_request_bytes is not None and len(body) > self.max_request_bytes:
            raise MeshditError(f"meshdit serve: {op}: the request is {len(body):,} bytes, over the "
                               f"server's --max-request-bytes {self.max_request_bytes:,}")
        self._events()
        self._lost = False
        self._sock.send_multipart([b"", body], copy=False)
        self.bytes_sent += len(body)
        limit = self.timeout if timeout == -1.0 else timeout
        t0 = time.monotonic()
        while True:
            left = None if limit is None else limit - (time.monotonic() - t0)
            wait_ms = 100 if left is None else max(0, min(100, int(left * 1000)))
            self._events()
            lost = self._lost or (not self._connected and time.monotonic() - t0 > CONNECT_GRACE_S)
            if lost:
                # a server this process watches says best what happened: give it a moment
                for _ in range(100 if self._alive else 0):
                    why = self._alive()
                    if why:
                        raise MeshditError(f"meshdit serve: {op}: {why}")
                    time.sleep(0.1)
                raise MeshditError(f"meshdit serve: {op}: {self._lost_why(self._lost)}")
            if self._sock.poll(wait_ms, zmq.POLLIN):
                frames = self._sock.recv_multipart(copy=False)
                blob = frames[-1].buffer
                self.bytes_received += len(blob)
                try:
                    meta, out = _blob.decode(blob)
                except ValueError as e:
                    raise MeshditError(f"meshdit serve: {op}: {e}") from None
                if meta.get("id") not in (rid, None):
                    continue  # the late reply of an earlier request that timed out
                if meta.get("status") != "ok":
                    raise ServerError(op, meta.get("error", "(an error reply without a message)"),
                                      meta)
                return meta, out
            why = self._alive() if self._alive else None
            if why:
                raise MeshditError(f"meshdit serve: {op}: {why}")
            if limit is not None and time.monotonic() - t0 >= limit:
                raise MeshditError(f"meshdit serve: {op}: no reply from {self.endpoint} within "
                                   f"{limit:g} s")

    def _events(self) -> bool:
        """Reads the connection's events; True when there were any."""
        seen = False
        while self._mon.poll(0):
            ev = recv_monitor_message(self._mon)["event"]
            seen = True
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif ev == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected, self._lost = False, True
        return seen

    def _lost_why(self, connected: bool = True) -> str:
        if connected:
            why = (f"the connection to {self.endpoint} closed while this request was pending: "
                   f"the server ended, was killed, or stopped answering heartbeats")
        else:
            why = (f"no server answered a connection to {self.endpoint} within "
                   f"{CONNECT_GRACE_S:g} s (it ended, was killed or stopped)")
        if self.endpoint.startswith("ipc://") and remove_stale_socket(self.endpoint[6:]):
            why += " (its socket file, which nobody listens on any more, was removed)"
        return why

    def info(self) -> dict:
        """The server's `info` metadata (family, class_name, config text, layout, memory)."""
        meta, _ = self.request({"op": "info"})
        if meta.get("max_request_bytes", "").isdigit():
            self.max_request_bytes = int(meta["max_request_bytes"])
        return meta

    def forward(self, tensors: Mapping[str, _blob.Raw], session: str | None = None,
                keep=(), end_session: bool = False,
                cache: Mapping[str, str] | None = None,
                lora: str | None = None, cfg_next: str | None = None) -> tuple[dict, dict]:
        """One transformer forward: (reply metadata, outputs as float32 numpy arrays).

        `session` is the caller's handle: the first forward of a handle (it must name what to
        `keep`) opens a session on the server and keeps the token the reply carries; later ones
        send that token. A handle this client has no token for, without `keep`, is an error
        reply's ServerError (`session 'H' is not open`), as the server would answer it.
        `cache`: the step cache's keys ("cache", "cache_context", "cache_generation";
        docs/serve.md), sent as they are. `lora`: the adapters to run with, ``NAME=WEIGHT,...``
        ("" for the base weights; None: those the server was started with)."""
        meta = {"op": "forward", **(cache or {})}
        if lora is not None:
            meta["lora"] = lora
        if cfg_next is not None:  # a --cfg 2 server: the other branch's session token
            meta["cfg_next"] = cfg_next
        wire = None
        if session is not None:
            wire = self._tokens.get(session)
            if wire is None:
                if not keep:
                    raise ServerError("forward", f"session '{session}' is not open (this client "
                                      f"holds no token for it)", {})
                wire = "new"
            meta["session"] = wire
            if keep:
                meta["keep"] = _blob.names(keep)
            if end_session:
                meta["end_session"] = "1"
        try:
            reply, out = self.request(meta, tensors)
        except ServerError as e:
            if session is None:
                raise
            if "is not open" in e.error:
                self._tokens.pop(session, None)  # ended or dropped on the server
            named = f"session '{wire}'" if wire != "new" else "a new session"
            err = e.error.replace(named, f"session '{session}'")
            raise ServerError("forward", err, e.metadata) from None
        if session is not None:
            if end_session or not reply.get("session"):
                self._tokens.pop(session, None)
            else:
                self._tokens[session] = reply["session"]
        return reply, out

    def end_session(self, session: str, timeout: float | None = -1.0) -> None:
        """Ends the session of handle `session` (a no-op for one this client holds no token
        for)."""
        token = self._tokens.pop(session, None)
        if token is not None:
            self.request({"op": "end_session", "session": token}, timeout=timeout)

    def end_cache_generation(self, generation: str, timeout: float | None = -1.0) -> None:
        """Drops the step cache state of `generation` on the server (a no-op for an unknown
        one)."""
        self.request({"op": "end_session", "cache_generation": generation}, timeout=timeout)

    def lora_load(self, name: str, metadata: Mapping[str, str], tensors: Mapping[str, _blob.Raw],
                  timeout: float | None = -1.0) -> dict:
        """Loads an adapter's factors (an adapter file's metadata and tensors, docs/lora.md) on
        the server under `name`; nothing is fused until a forward names it in its `lora`.
        Returns the reply's metadata (linear_weights, rank_min, rank_max, factor_bytes)."""
        meta, _ = self.request({**metadata, "op": "lora_load", "adapter_name": name}, tensors,
                               timeout=timeout)
        return meta

    def lora_unload(self, name: str, timeout: float | None = -1.0) -> None:
        """Drops adapter `name` from the server."""
        self.request({"op": "lora_unload", "adapter_name": name}, timeout=timeout)

    def close_server(self, timeout: float = 30.0) -> None:
        """Asks the server to exit (every rank, exit 0); the reply comes first."""
        self.request({"op": "close"}, timeout=timeout)

    def close(self) -> None:
        """Closes this connection (the server goes on)."""
        with self._lock:
            if self._sock is not None:
                self._sock.disable_monitor()
                self._mon.close(0)
                self._sock.close(0)
                self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
