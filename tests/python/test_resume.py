"""A generation that survives a lost rank, from `meshdit.Transformer` directly
(`from_pretrained(..., resume=...)`, meshdit/_resume.py): a rank killed between two steps, a rank
that stalls, a failure injected into the first launch only, a relaunch that falls back to a
smaller layout; each result equals the uninterrupted generation."""
import os
import signal
import time

import numpy as np
import pytest

import flux_pipeline
import meshdit
from service_util import kill_rank, serve_processes


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume") / "flux_tiny")
    flux_pipeline.build(root, seed=0)
    return root


def _kill_after_first_step(t, sig=signal.SIGKILL):
    def cb(pipe, i, timestep, tensors):
        if i == 0:
            kill_rank(t._server.endpoint[len("ipc://"):], 1, sig)
        return {}
    return cb


def test_a_generation_survives_a_rank_killed_mid_way(flux_root):
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2, resume=True) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        ref = flux_pipeline.generate(pipe, seed=3, steps=3)
        first = t._server
        img = flux_pipeline.generate(pipe, seed=3, steps=3, callback_on_step_end=_kill_after_first_step(t))
        assert t._server is not first and first.proc.poll() is not None  # a new mesh
        [rec] = t.resumes
        assert rec["ok"] and "killed (signal 9" in rec["error"] and rec["forward"] == 4
        assert rec["layout"] == {"tp": 2, "ring": 1, "ulysses": 1} and 0 < rec["seconds"] < 60
        assert t.stats["forwards"] == 6
    assert float(np.max(np.abs(img - ref))) <= 1e-5  # the uninterrupted generation's image


def test_without_resume_a_killed_rank_ends_the_generation(flux_root):
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        with pytest.raises(meshdit.MeshditError, match="killed"):
            flux_pipeline.generate(pipe, seed=3, steps=3, callback_on_step_end=_kill_after_first_step(t))


def test_a_stalled_rank_is_relaunched(flux_root):
    """A rank stopped between two steps: rank 0 waits in the next request's agreement, which the
    server's watchdog does not watch; the client's stall bound ends it and relaunches."""
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2,
                                             resume={"stall_timeout": 3}) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        ref = flux_pipeline.generate(pipe, seed=5, steps=3)
        first = t._server
        t0 = time.monotonic()
        img = flux_pipeline.generate(pipe, seed=5, steps=3,
                                     callback_on_step_end=_kill_after_first_step(t, signal.SIGSTOP))
        assert time.monotonic() - t0 < 30
        [rec] = t.resumes
        assert "no reply within 3 s" in rec["error"] and rec["detect_seconds"] >= 3
    assert first.proc.poll() is not None and not serve_processes(first.endpoint[len("ipc://"):])
    assert float(np.max(np.abs(img - ref))) <= 1e-5


def test_the_first_forward_fails_on_the_first_launch_only(flux_root):
    """MESHDIT_TEST_FAIL=step:1:kill kills rank 1 in the first launch's first forward; a relaunch
    runs without it, and the generation equals one that never failed."""
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2) as t:
        ref = flux_pipeline.generate(flux_pipeline.load(flux_root, transformer=t), seed=3, steps=2)
    env = dict(os.environ, MESHDIT_TEST_FAIL="step:1:kill")
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2, env=env, resume=True) as t:
        img = flux_pipeline.generate(flux_pipeline.load(flux_root, transformer=t), seed=3, steps=2)
        assert [r["forward"] for r in t.resumes] == [0]
    assert float(np.max(np.abs(img - ref))) <= 1e-5


def test_a_relaunch_falls_back_to_a_smaller_layout(flux_root):
    """When the same layout cannot start again (here every relaunch's rank 1 fails its load), the
    next layout of `layouts` that starts takes over; the result is then the smaller layout's."""
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2) as t:
        ref = flux_pipeline.generate(flux_pipeline.load(flux_root, transformer=t), seed=3, steps=3)
    env = dict(os.environ, MESHDIT_TEST_FAIL="load:1")
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2,
                                             resume={"env": env, "layouts": [{"tp": 1}]}) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        img = flux_pipeline.generate(pipe, seed=3, steps=3, callback_on_step_end=_kill_after_first_step(t))
        [rec] = t.resumes
        assert rec["layout"] == {"tp": 1, "ring": 1, "ulysses": 1} and t.info["world"] == "1"
    assert float(np.max(np.abs(img - ref)) / np.max(np.abs(ref))) <= 1e-4


def test_resume_options_are_checked(flux_root):
    for bad, msg in (({"retries": 2}, "unknown"), ({"layouts": [{"pp": 2}]}, "tp, ring, ulysses"),
                     ({"stall_timeout": -1}, "stall_timeout")):
        with pytest.raises(TypeError, match=msg):
            meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", resume=bad)
