"""A generation that survives a lost rank: relaunch the mesh and redo the forward that failed.

The client holds everything a forward needs: the pipeline keeps the latents between steps and
every forward's inputs are in hand when it is sent. So when the `meshdit serve` job ends under a
forward (a rank killed, a rank that stalls until the server's step watchdog ends the job and
names it, a rank that fails alone and makes the job abort), nothing of the generation is lost
but that one forward: this module starts the job again (the same layout, else the next of the
`layouts` given that starts), forgets every server session (they died with the job), and sends
the failed forward's full inputs again. With the same layout the redone forward is the same
computation, so the generation's result equals the uninterrupted one.

`enable(t, start, options)` is called by `Transformer.from_pretrained(..., resume=...)`; `start`
makes a new `Server` with the original options (keyword arguments override them). Options
(``resume=True`` or a dict):

- ``max_restarts`` (default 2): relaunches for one forward before its error is raised.
- ``layouts``: layouts tried after the original one fails to start, in order, as dicts of
  tp/ring/ulysses (an axis left out is 1), e.g. ``[{"tp": 1}]`` where fewer ranks are left.
- ``env``: the environment of relaunched jobs (default: the first launch's, less
  ``MESHDIT_TEST_FAIL``: a test's injected failure belongs to the first launch only).
- ``probe_timeout`` (default 30 s): after an error reply, how long an ``info`` request may take
  to tell a server that goes on (the error was the request's) from one that is ending.
- ``stall_timeout`` (default ``"auto"``): a forward with no reply for this long is taken for a
  stalled rank: the job is killed and relaunched. The server's step watchdog names a rank that
  stalls inside a forward and ends the job itself; this bound also covers a rank that stops
  between two requests, where rank 0 waits in the request's own agreement, unwatched. ``"auto"``
  is twice the server's bound (``step_timeout`` if given, else 10 x the longest forward so far
  and at least 60 s); None: no bound but the client's ``timeout``.

Each recovery appends a record to ``t.resumes`` and calls every ``t.resume_listeners`` entry with
it: ``forward`` (the index of the forward that failed), ``error`` (the job's own line),
``layout``, ``detect_seconds`` (the failed attempt until the loss was seen), ``relaunch_seconds``,
``redo_seconds`` and ``seconds`` (their sum: what the loss cost).

A relaunch starts the job from the thread that runs the forward (Linux ends a launcher when the
thread that started it ends: docs/python.md).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import weakref

from . import _lora
from ._sessions import Planner
from .client import MeshditError, ServerError

_LAYOUT = ("tp", "ring", "ulysses")
_OPTIONS = {"max_restarts", "layouts", "env", "probe_timeout", "stall_timeout"}


def _options(resume) -> dict:
    opts = {"max_restarts": 2, "layouts": [], "env": None, "probe_timeout": 30.0,
            "stall_timeout": "auto"}
    if resume is True:
        return opts
    if not isinstance(resume, dict):
        raise TypeError(f"meshdit: resume={resume!r}: True or a dict of {sorted(_OPTIONS)}")
    bad = set(resume) - _OPTIONS
    if bad:
        raise TypeError(f"meshdit: resume option(s) {sorted(bad)} unknown; known: {sorted(_OPTIONS)}")
    opts.update(resume)
    layouts = []
    for lay in opts["layouts"]:
        if not isinstance(lay, dict) or set(lay) - set(_LAYOUT):
            raise TypeError(f"meshdit: resume layout {lay!r}: a dict of tp, ring, ulysses")
        layouts.append({k: int(lay.get(k, 1)) for k in _LAYOUT})
    opts["layouts"] = layouts
    if not isinstance(opts["max_restarts"], int) or opts["max_restarts"] < 0:
        raise TypeError(f"meshdit: resume max_restarts {opts['max_restarts']!r}: an integer >= 0")
    st = opts["stall_timeout"]
    if not (st is None or st == "auto" or (isinstance(st, (int, float)) and st > 0)):
        raise TypeError(f"meshdit: resume stall_timeout {st!r}: 'auto', None or seconds > 0")
    return opts


def enable(t, start, resume) -> None:
    """Makes `t`'s forwards survive the loss of its server job (see the module docstring)."""
    opts = _options(resume)
    env = opts["env"]
    if env is None:  # the first launch's environment (start's env=, else this process's)
        first = getattr(start, "keywords", {}).get("env")
        env = dict(os.environ if first is None else first)
        env.pop("MESHDIT_TEST_FAIL", None)
    state = _Resumer(t, start, opts, env)
    t.resumes = []
    t.resume_listeners = []
    t._forward = state.forward  # an instance attribute: Transformer._run calls self._forward


class _Resumer:
    def __init__(self, t, start, opts, env):
        self._t = weakref.ref(t)  # no cycle: a dropped Transformer still stops its server
        self.start, self.opts, self.env = start, opts, env
        self.layout = {k: int(t.info.get(k, 1)) for k in _LAYOUT}
        kw = getattr(start, "keywords", {})
        self.user_timeout, self.step_timeout = kw.get("timeout"), kw.get("step_timeout")
        self.longest = 0.0  # the longest forward so far, seconds

    def _bound(self) -> float | None:
        st = self.opts["stall_timeout"]
        if st == "auto":
            st = 2.0 * (float(self.step_timeout) if self.step_timeout else max(60.0, 10 * self.longest))
        if st is not None and self.user_timeout is not None:
            st = min(st, self.user_timeout)
        return self.user_timeout if st is None else st

    @property
    def t(self):
        t = self._t()
        if t is None:
            raise MeshditError("meshdit: the Transformer is gone")
        return t

    def orig(self, raws):
        t = self.t
        return type(t)._forward(t, raws)  # the class's forward through the planner

    def _lost(self, err: MeshditError) -> str | None:
        """The job's line if the server job is gone (or hung past the client's timeout), else
        None (the error was the request's: raise it)."""
        server = self.t._server
        if server is None:
            return None  # connect(): not ours to relaunch
        if server.proc.poll() is not None:
            return server.error_line() or str(err)
        if isinstance(err, ServerError):
            # an error reply: a server that goes on answers info; one whose rank failed alone
            # replied first and is ending (MPI_Abort)
            try:
                if server.client is not None:
                    server.client.request({"op": "info"}, timeout=self.opts["probe_timeout"])
                return None
            except ServerError:
                return None
            except MeshditError:
                pass
            for _ in range(100):  # give the launcher a moment to report the exit
                if server.proc.poll() is not None:
                    break
                time.sleep(0.05)
            return server.error_line() or err.error
        if "no reply from" in str(err):  # hung: relaunch
            return (f"no reply within {self.t._client.timeout:g} s (a stalled rank, or a forward "
                    f"slower than the stall bound)")
        return None  # a client-side refusal (closed, over --max-request-bytes)

    def forward(self, raws):
        t = self.t
        restarts = 0
        while True:
            if t._client is not None:
                t._client.timeout = self._bound()
            t0 = time.perf_counter()
            try:
                out = self.orig(raws)
                self.longest = max(self.longest, time.perf_counter() - t0)
                return out
            except MeshditError as e:
                why = self._lost(e)
                if why is None or restarts >= self.opts["max_restarts"]:
                    raise
                restarts += 1
                detect = time.perf_counter() - t0
                t1 = time.perf_counter()
                layout = self._relaunch(why, e)
                relaunch = time.perf_counter() - t1
                t2 = time.perf_counter()
                out = None
                try:
                    t._client.timeout = self._bound()
                    out = self.orig(raws)
                finally:
                    rec = {"forward": int(t.stats["forwards"]), "error": why, "layout": layout,
                           "world": int(t.info.get("world", 0)), "detect_seconds": detect,
                           "relaunch_seconds": relaunch,
                           "redo_seconds": time.perf_counter() - t2, "ok": out is not None}
                    rec["seconds"] = detect + relaunch + rec["redo_seconds"]
                    t.resumes.append(rec)
                    for fn in list(t.resume_listeners):
                        fn(dict(rec))
                return out

    def _relaunch(self, why: str, err: MeshditError) -> dict:
        t = self.t
        old = t._server
        if old.proc.poll() is None:
            # lost but running (a stalled rank): no close request, no SIGTERM that a rank stuck in
            # a collective cannot act on; MPICH's launcher takes every rank with it
            try:
                os.kill(old.proc.pid, signal.SIGKILL)
                old.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            old.close()  # reaps the job; its temp dir goes
        except Exception:  # noqa: BLE001 - the old job is gone either way
            pass
        tried = []
        for lay in [self.layout] + [x for x in self.opts["layouts"] if x != self.layout]:
            try:
                server = self.start(env=self.env, **lay)
            except MeshditError as e:
                tried.append(f"{lay}: {e}")
                continue
            planner = t._planner
            t._server, t._client, t.info = server, server.client, dict(server.info)
            t._planner = Planner(planner.capacity)  # the sessions died with the old job
            t._stale = []
            _lora.reload(t)  # so did its adapters: this drop-in holds their factors
            t._cfg_pairs.clear()  # and the sessions the cfg pairs named
            t._cfg_last = t._cfg_prev = t._cfg_asked = None
            self.layout = lay
            return dict(lay)
        t._client = None  # nothing to talk to: later calls raise "closed"
        t._server = None
        raise MeshditError(f"meshdit: lost the mesh ({why}) and could not start it again: "
                           + "; ".join(tried)) from err
