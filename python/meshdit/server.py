"""Starting and stopping a `meshdit serve` job from Python.

`Server` runs ``launcher + [binary, "serve", ...]`` as a child process (in its own process group),
waits for rank 0's ``serving on ENDPOINT`` line, and stops the job when closed: a ``close``
request first (every rank exits 0), then SIGTERM to the group, then SIGKILL. The job's stdout and
stderr go to a log file, so a failed start or a rank that fails later is reported with the
server's own one-line error.

The job follows this process, not the thread that started it: its standard input is a pipe
whose other end only this process holds, and the server runs with ``--owner-stdin``, so rank 0
stops the job (every rank exits 0, a forward under way is ended) as soon as this process is
gone, however it ended — SIGKILL, SIGTERM from ``timeout``, a crash — while a Server made in a
worker thread (a Gradio or FastAPI loader) lives on after that thread ends. (The launcher's
PR_SET_PDEATHSIG did the opposite: it fired when the *thread* that forked it ended, and not at
all for some ways the process died.)
"""
from __future__ import annotations

import numbers
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
import weakref
from typing import Sequence

from .client import Client, MeshditError, remove_stale_socket

_LAYOUT = ("cfg", "tp", "ring", "ulysses")


def _is_python_command(path: str) -> bool:
    """The `meshdit` console script of this package (pip writes `from meshdit.__main__ import
    main` into it), which shares the C binary's name."""
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError:
        return False
    return head.startswith(b"#!") and b"meshdit.__main__" in head


def find_binary(binary: str | None = None) -> str:
    """The meshdit executable: `binary`, else $MESHDIT_BIN, else the first `meshdit` on PATH that
    is not this package's Python command."""
    cand = binary or os.environ.get("MESHDIT_BIN")
    if not cand:
        for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
            found = shutil.which("meshdit", path=d or ".")
            if found and not _is_python_command(found):
                cand = found
                break
    if not cand:
        raise MeshditError("meshdit: no meshdit executable: pass binary=PATH, set MESHDIT_BIN, or "
                           "put meshdit on PATH (it is build/meshdit after `make`)")
    if not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
        raise MeshditError(f"meshdit: '{cand}' is not an executable file")
    if _is_python_command(cand):
        raise MeshditError(f"meshdit: '{cand}' is the Python meshdit command, not the C binary "
                           f"(build/meshdit after `make`)")
    return os.path.abspath(cand)


def default_launcher(world: int) -> list:
    """``[mpiexec, -n, world]``, MPICH's mpiexec when both are installed (the tests use MPICH)."""
    mpiexec = shutil.which("mpiexec.mpich") or shutil.which("mpiexec")
    if not mpiexec:
        raise MeshditError("meshdit: no mpiexec on PATH: install MPICH or pass launcher=[...]")
    return [mpiexec, "-n", str(world)]


# what keeps a one-host job's MPI sockets on loopback, per MPI: UCX (MPICH ch4:ucx, Open MPI's
# pml ucx), Open MPI's own TCP paths, libfabric's TCP and sockets providers, MPICH ch3's TCP,
# and hydra's proxies; hydra's PMI port needs the preload library below (it binds 0.0.0.0)
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "OMPI_MCA_btl_tcp_if_include": "lo",
                "OMPI_MCA_oob_tcp_if_include": "lo", "FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo",
                "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": "127.0.0.1", "HYDRA_IFACE": "lo"}


def loopback_env(env: dict, exe: str) -> dict:
    """`env` with the variables and the preload library (build/libmeshdit_loopback.so, beside the
    binary, or $MESHDIT_LOOPBACK_LIB) that keep every socket of a one-host job on loopback;
    variables the caller set win. Without the library a warning says hydra's port stays open."""
    out = dict(env)
    for k, v in LOOPBACK_ENV.items():
        out.setdefault(k, v)
    lib = out.get("MESHDIT_LOOPBACK_LIB") or os.path.join(os.path.dirname(exe),
                                                           "libmeshdit_loopback.so")
    if os.path.isfile(lib):
        out["LD_PRELOAD"] = " ".join(p for p in (lib, out.get("LD_PRELOAD", "")) if p)
    else:
        warnings.warn(f"meshdit: no {lib}: the launcher's PMI port will listen on every "
                      f"interface (build it with make, or set MESHDIT_LOOPBACK_LIB)",
                      stacklevel=3)
    return out


def _size_arg(v) -> str:
    return str(v) if isinstance(v, str) else str(int(v))


class Server:
    """A `meshdit serve` job owned by this process. Use `client` to talk to it; `close()` ends it.

    Options follow `meshdit serve` (docs/serve.md): cfg, tp, ring, ulysses, mesh_order, device, dtype,
    comm, max_memory, max_sessions, max_session_bytes, session_idle, max_request_bytes,
    max_queue_bytes, step_timeout, load_timeout; `extra` is appended as is. `launcher` is the command line that starts `world` ranks (default
    ``mpiexec -n cfg*tp*ring*ulysses``); `endpoint` defaults to a socket in a private temp dir.
    `loopback` (default: True with the default launcher, which runs every rank on this host)
    keeps every socket of the MPI job on loopback (`loopback_env`); a launcher across hosts must
    leave it False. `watch_owner` (default True) ends the job when this process ends.
    """

    def __init__(self, checkpoint: str, *, cfg: int = 1, tp: int = 1, ring: int = 1,
                 ulysses: int = 1, mesh_order: str | None = None, device: str | None = None,
                 dtype: str | None = None, comm: str | None = None, max_memory=None,
                 max_sessions: int | None = None, max_session_bytes=None,
                 session_idle: float | None = None, max_request_bytes=None,
                 max_queue_bytes=None, step_timeout: float | None = None,
                 load_timeout: float | None = None,
                 launcher: Sequence[str] | None = None, binary: str | None = None,
                 endpoint: str | None = None, extra: Sequence[str] = (), env=None,
                 startup_timeout: float = 600.0, timeout: float | None = None,
                 watch_owner: bool = True, loopback: bool | None = None):
        if not isinstance(checkpoint, (str, os.PathLike)) or not os.path.isdir(checkpoint):
            raise MeshditError(f"meshdit: checkpoint '{checkpoint}' is not a directory")
        layout = []
        for k, v in zip(_LAYOUT, (cfg, tp, ring, ulysses)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise MeshditError(f"meshdit: {k}={v!r}: must be an integer >= 1")
            layout.append(int(v))
        cfg, tp, ring, ulysses = layout
        if cfg > 2:
            raise MeshditError(f"meshdit: cfg={cfg}: 1 or 2 (the two branches of a guided step)")
        world = cfg * tp * ring * ulysses
        exe = find_binary(binary)  # both resolved before anything is made
        launch = (default_launcher(world) if launcher is None else
                  shlex.split(launcher) if isinstance(launcher, str) else list(launcher))
        extra = shlex.split(extra) if isinstance(extra, str) else list(extra)
        self._tmp = tempfile.mkdtemp(prefix="meshdit-")
        self.endpoint = endpoint or f"ipc://{self._tmp}/serve.sock"
        args = [exe, "serve", "--checkpoint", os.path.abspath(checkpoint),
                "--cfg", str(cfg), "--tp", str(tp), "--ring", str(ring), "--ulysses",
                str(ulysses), "--listen", self.endpoint]
        if watch_owner:  # rank 0 ends the job when this process's end of its stdin closes
            args.append("--owner-stdin")
        opt = {"--mesh-order": mesh_order, "--device": device, "--dtype": dtype, "--comm": comm,
               "--max-memory": max_memory, "--max-sessions": max_sessions,
               "--max-session-bytes": max_session_bytes, "--session-idle": session_idle,
               "--max-request-bytes": max_request_bytes, "--max-queue-bytes": max_queue_bytes,
               "--step-timeout": step_timeout or None,  # 0: the default bound, as _resume reads it
               "--load-timeout": load_timeout}
        for k, v in opt.items():
            if v is not None:
                if isinstance(v, float) and v.is_integer():  # the C options take whole seconds
                    v = int(v)
                args += [k, _size_arg(v) if k.startswith("--max") else str(v)]
        args += extra
        self.command = launch + args
        self.log_path = os.path.join(self._tmp, "serve.log")
        self._log = open(self.log_path, "wb")
        run_env = dict(os.environ if env is None else env)
        run_env.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread per rank
        if launcher is None if loopback is None else loopback:  # a one-host job: loopback only
            run_env = loopback_env(run_env, exe)
        try:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE if watch_owner else
                                         subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=run_env,
                                         start_new_session=True)
        except OSError as e:
            self._log.close()
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise MeshditError(f"meshdit: cannot start {self.command[0]}: {e}") from None
        # a Server dropped or left at exit without close(): SIGTERM at once (weakref.finalize
        # also runs at interpreter exit)
        sock = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._log, self._tmp, 0.0, sock)
        self._wait_ready(startup_timeout)
        alive = weakref.WeakMethod(self._alive)  # no cycle: a dropped Server is stopped at once
        self.client = Client(self.endpoint, timeout=timeout,
                             alive=lambda: (alive() or (lambda: "the server was closed"))())
        try:
            self.info = self.client.info()  # also teaches the client --max-request-bytes
        except BaseException:
            self.close()
            raise

    # -- the job's state ------------------------------------------------------------------------
    def log(self) -> str:
        """Everything the job printed so far."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def error_line(self) -> str:
        """The job's last `meshdit: error: ...` line; else, for a rank the launcher saw killed,
        which signal; else its last line, or ''."""
        lines = [ln.strip() for ln in self.log().splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("meshdit: ")]
        if errs:
            return errs[-1]
        for ln in reversed(lines):  # MPICH: "... EXIT STRING: Killed (signal 9)"
            m = re.search(r"(Killed|Terminated|Segmentation fault|Aborted)?\s*\(signal (\d+)\)", ln)
            if m:
                return f"a rank was killed (signal {m.group(2)}{', ' + m.group(1) if m.group(1) else ''})"
        return (lines or [""])[-1]

    def _alive(self) -> str | None:
        rc = self.proc.poll()
        if rc is None:
            return None
        line = self.error_line()
        return f"the server exited with status {rc}" + (f": {line}" if line else "")

    def _wait_ready(self, timeout: float) -> None:
        want = "serving on "
        t0 = time.monotonic()
        while True:
            for ln in self.log().splitlines():
                if ln.startswith(want):
                    self.endpoint = ln[len(want):].strip()  # tcp://HOST:* prints the port
                    return
            why = self._alive()
            if why or time.monotonic() - t0 > timeout:
                if not why:
                    why = f"no 'serving on' line within {timeout:g} s"
                self.close()
                raise MeshditError(f"meshdit serve did not start: {why}")
            time.sleep(0.05)

    # -- ending it ------------------------------------------------------------------------------
    def close(self) -> int | None:
        """Ends the job (close request, then SIGTERM, then SIGKILL); returns its exit status."""
        client, closed = getattr(self, "client", None), False
        if client is not None and self.proc.poll() is None:
            try:
                client.close_server(timeout=30.0)
                closed = True
            except MeshditError:
                pass
        if client is not None:
            client.close()
        self.client = None
        if self._finalizer.detach() is None:
            return self.proc.poll()  # closed before
        sock = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        return _stop(self.proc, self._log, self._tmp, 10.0 if closed else 0.0, sock)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stop(proc, log, tmp, grace: float, sock: str | None = None) -> int | None:
    """Waits `grace` s for the job to end by itself (after a close request), then SIGTERM to its
    process group (every rank exits 0 within seconds), then SIGKILL; removes the temp dir and a
    socket file `sock` that a killed job left behind (nobody listening on it)."""
    if proc.stdin is not None:  # the owner pipe: closing it alone stops the job
        try:
            proc.stdin.close()
        except OSError:
            pass
    for sig, wait in ((None, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    log.close()
    if sock and proc.poll() is not None:
        remove_stale_socket(sock)
    shutil.rmtree(tmp, ignore_errors=True)
    return proc.poll()
