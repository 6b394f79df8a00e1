"""What the tests of `meshdit generate` and `meshdit api` share: starting the service as a user
does (``python -m meshdit api``), finding the mesh's rank processes, decoding images."""
import base64
import io
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")


def env_with_package(extra=None):
    """This process's environment with this tree's package first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def meshdit_cmd(*args):
    return [sys.executable, "-m", "meshdit", *args]


class Api:
    """`python -m meshdit api ...` as a child process on a free port; `.url`, `.log()`."""

    def __init__(self, model, *args, env=None, startup=120.0):
        self.model = model
        self.log_path = os.path.join(os.path.dirname(model.rstrip("/")), f"api-{os.getpid()}-{time.monotonic_ns()}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(meshdit_cmd("api", "--model", model, "--port", "0", *args),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env_with_package(env))
        t0 = time.monotonic()
        while True:
            m = re.search(r"^listening on (http://\S+)$", self.log(), re.M)
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() - t0 > startup:
                self.stop()
                raise RuntimeError(f"meshdit api did not start:\n{self.log()}")
            time.sleep(0.1)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout=60.0):
        """Sends `sig`, waits; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def rank_pids(marker):
    """{world rank: pid} of the `meshdit serve` processes whose command line contains `marker`
    (the checkpoint path of a test's own pipeline, or a server's socket path). MPICH gives every
    rank PMI_RANK in its environment."""
    out = {}
    key = marker.encode()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"serve" not in cmd or not any(key in c for c in cmd) or b"mpiexec" in cmd[0]:
                continue
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for e in env:
            if e.startswith(b"PMI_RANK="):
                out[int(e[len(b"PMI_RANK="):])] = int(p)
    return out


def serve_processes(marker):
    """pids of every process (launcher and ranks) whose command line names `marker`."""
    key = marker.encode()
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if key in cmd and b"serve" in cmd:
            found.append(int(p))
    return found


def kill_rank(marker, rank, sig=signal.SIGKILL):
    pids = rank_pids(marker)
    assert rank in pids, f"no rank {rank} among {pids}"
    os.kill(pids[rank], sig)


def png_pixels(data):
    """Decoded pixels (uint8 [H, W, 3]) of PNG bytes or base64 text."""
    from PIL import Image
    if isinstance(data, str):
        data = base64.b64decode(data)
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pil_pixels(img):
    return np.asarray(img.convert("RGB"))


def levels(a, b):
    """The largest difference of two uint8 images in 8-bit levels."""
    return int(np.max(np.abs(a.astype(np.int16) - b.astype(np.int16))))
