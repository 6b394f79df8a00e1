"""meshdit's Python package against a real `meshdit serve`: the blob codec, the drop-in's
outputs (equal to `meshdit run` byte for byte and to the diffusers goldens), sessions (fewer
bytes, the same results; sessions off is the negative control), refused arguments, error
replies, a server that cannot start or dies, connect/close."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load, load_file, save, save_file
from safetensors.torch import load as tload

import meshdit
from meshdit import _blob

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")
BIN = os.environ["MESHDIT_BIN"]
FLUX = os.path.join(DATA, "flux_tiny")
H3 = os.path.join(DATA, "h3_tiny")


def tensors(path):
    return {k: torch.from_numpy(v) for k, v in load_file(path).items()}


def meshdit_run(ck, inputs, tmp_path, **layout):
    """`meshdit run` on the same inputs and layout: the in-process reference for the server."""
    world = 1
    args = []
    for k, v in layout.items():
        args += [f"--{k}", str(v)]
        world *= v
    out = str(tmp_path / "run.safetensors")
    subprocess.run(["mpiexec.mpich", "-n", str(world), BIN, "run", "--checkpoint", ck,
                    "--inputs", inputs, "--out", out, "--quiet"] + args, check=True,
                   capture_output=True, timeout=120)
    return load_file(out)


# ---- the blob codec ----------------------------------------------------------------------------
def test_blob_round_trip_with_safetensors():
    arrs = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -2], np.int64),
            "c": np.zeros((0, 5), np.float16), "d": np.array(3.5, np.float64),
            "e": np.array([True, False])}
    blob = b"".join(_blob.encode({"op": "x", "k": "v"}, {k: _blob.raw(v) for k, v in arrs.items()}))
    back = load(blob)  # the safetensors package reads what we write
    assert set(back) == set(arrs)
    for k in arrs:
        assert back[k].dtype == arrs[k].dtype and np.array_equal(back[k], arrs[k])
    meta, mine = _blob.decode(save(arrs, metadata={"status": "ok"}))  # and we read what it writes
    assert meta == {"status": "ok"}
    for k in arrs:
        assert np.array_equal(mine[k], arrs[k])


def test_blob_bf16_as_raw_bytes():
    from meshdit.transformer import _to_raw
    t = torch.randn(3, 5).to(torch.bfloat16)
    blob = b"".join(_blob.encode({}, {"t": _to_raw("t", t)}))
    assert torch.equal(tload(blob)["t"], t)


@pytest.mark.parametrize("bad", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]",
                                 b"\xff" * 8 + b"{}"])
def test_blob_decode_refuses_garbage(bad):
    with pytest.raises(ValueError, match="meshdit: "):
        _blob.decode(bad)


# ---- the drop-in on the tiny goldens ---------------------------------------------------------
@pytest.fixture(scope="module")
def flux_tp2():
    t = meshdit.Transformer.from_pretrained(FLUX, tp=2)
    yield t
    t.close()


def test_flux_equals_run_and_golden(flux_tp2, tmp_path):
    inp = os.path.join(FLUX, "inputs.safetensors")
    out = flux_tp2(**tensors(inp))
    assert isinstance(out, meshdit.transformer.Transformer2DModelOutput)
    got = out.sample.numpy()
    assert np.array_equal(got, meshdit_run(FLUX, inp, tmp_path, tp=2)["sample"])  # bit for bit
    exp = load_file(os.path.join(FLUX, "expected.safetensors"))["sample"]
    assert np.max(np.abs(got - exp)) <= 2e-5 * max(1.0, np.max(np.abs(exp)))
    (tup,) = flux_tp2(**tensors(inp), return_dict=False)
    assert torch.equal(tup, out.sample)


def test_flux_config_dtype_device(flux_tp2):
    assert flux_tp2.config.num_attention_heads == 2 and flux_tp2.config["in_channels"] == 4
    assert flux_tp2.config._class_name == "FluxTransformer2DModel"
    assert flux_tp2.dtype == torch.float32 and flux_tp2.device == torch.device("cpu")
    assert isinstance(flux_tp2, meshdit.FluxTransformer)
    with flux_tp2.cache_context("cond"):
        pass


def test_outputs_in_callers_dtype(flux_tp2):
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    ref = flux_tp2(**args).sample
    args = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in args.items()}
    got = flux_tp2(**args).sample
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref, atol=0.1, rtol=0.1)  # bf16 inputs: close, not equal


def test_sessions_send_less_and_change_nothing(tmp_path):
    """Two prompts alternating (classifier-free guidance) with sessions: each prompt's tensors
    go once; the outputs equal those of a client without sessions (the negative control, which
    sends everything every step)."""
    base = tensors(os.path.join(FLUX, "inputs.safetensors"))
    other = dict(base, encoder_hidden_states=base["encoder_hidden_states"] * 0.5 + 0.1)
    steps = []
    for i in range(3):
        for a in (base, other):
            steps.append(dict(a, hidden_states=a["hidden_states"] + 0.1 * i,
                              timestep=torch.tensor([0.9 - 0.2 * i])))
    with meshdit.Transformer.from_pretrained(FLUX, tp=2) as t, \
            meshdit.Transformer.connect(t._client.endpoint, sessions=False) as plain:
        got = [t(**s).sample for s in steps]
        ref = [plain(**s).sample for s in steps]
        sent, full = t.stats["request_bytes"], plain.stats["request_bytes"]
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    assert len(set(full)) == 1  # without sessions every step carries everything
    assert sent[0] >= full[0] and sent[1] >= full[0]  # each prompt opens a session of its own
    assert all(b < full[0] / 5 for b in sent[2:]), (sent, full)  # then only what changes
    assert len(t._planner.open) == 0  # close() ended them


def test_in_place_change_is_sent_again(flux_tp2):
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    a = flux_tp2(**args).sample
    args["encoder_hidden_states"].mul_(0.5)  # the same tensor object, new content
    b = flux_tp2(**args).sample
    with meshdit.Transformer.connect(flux_tp2._client.endpoint, sessions=False) as plain:
        assert torch.equal(b, plain(**args).sample)
    assert not torch.equal(a, b)


def test_unsupported_arguments_raise(flux_tp2):
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    with pytest.raises(NotImplementedError, match="not supported"):
        flux_tp2(**args, joint_attention_kwargs={"scale": 0.5, "other": 1})


def test_controlnet_arguments(flux_tp2):
    """ControlNet residuals go to the mesh (test_dropin checks them against diffusers): a residual
    that is not [B, S_img, C] is refused in one line; the repeat flag without residuals is
    ignored, as diffusers ignores it."""
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    with pytest.raises(ValueError, match="every residual must be \\[B, S_img, C\\]"):
        flux_tp2(**args, controlnet_block_samples=[torch.zeros(1)])
    assert torch.equal(flux_tp2(**args, controlnet_blocks_repeat=True).sample, flux_tp2(**args).sample)


def test_error_reply_then_still_serving(flux_tp2):
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    bad = dict(args, encoder_hidden_states=args["encoder_hidden_states"][..., :31])
    with pytest.raises(meshdit.ServerError) as e:
        flux_tp2(**bad)
    assert "encoder_hidden_states" in e.value.error and "\n" not in e.value.error
    nan = dict(args, hidden_states=args["hidden_states"].clone().fill_(float("nan")))
    with pytest.raises(meshdit.ServerError, match="hidden_states"):
        flux_tp2(**nan)
    assert flux_tp2(**args).sample.isfinite().all()


def test_h3_equals_golden(tmp_path):
    inp = os.path.join(H3, "inputs.safetensors")
    exp = load_file(os.path.join(H3, "expected.safetensors"))
    with meshdit.Transformer.from_pretrained(H3, tp=2, ulysses=2) as t:
        assert isinstance(t, meshdit.MiniMaxH3Transformer)
        out = t(**tensors(inp))
        run = meshdit_run(H3, inp, tmp_path, tp=2, ulysses=2)
        for k in ("sample", "audio_sample"):
            got = getattr(out, k).numpy()
            assert np.array_equal(got, run[k])
            assert np.max(np.abs(got - exp[k])) <= 2e-5 * max(1.0, np.max(np.abs(exp[k])))
        v, a = t(**tensors(inp), return_dict=False)
        assert torch.equal(v, out.sample) and torch.equal(a, out.audio_sample)
        # the LoRA scale of a forward: no adapter is loaded, so nothing changes (as in diffusers)
        assert torch.equal(t(**tensors(inp), attention_kwargs={"scale": 2.0}).sample, out.sample)
        with pytest.raises(NotImplementedError, match="'other'"):
            t(**tensors(inp), attention_kwargs={"scale": 2.0, "other": 1})


def test_family_mismatch_is_an_error():
    with pytest.raises(meshdit.MeshditError, match="not FluxTransformer2DModel"):
        meshdit.FluxTransformer.from_pretrained(H3)


# ---- starting, failing, ending ---------------------------------------------------------------
def test_start_failure_reports_the_servers_line(tmp_path):
    (tmp_path / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    t0 = time.monotonic()
    with pytest.raises(meshdit.MeshditError, match="did not start: the server exited with status 1: meshdit: error: "):
        meshdit.Transformer.from_pretrained(str(tmp_path))
    assert time.monotonic() - t0 < 60
    with pytest.raises(meshdit.MeshditError, match="not an executable"):
        meshdit.Transformer.from_pretrained(FLUX, binary=str(tmp_path / "nope"))
    with pytest.raises(meshdit.MeshditError, match="must be an integer"):
        meshdit.Transformer.from_pretrained(FLUX, tp=0)


def test_a_rank_that_fails_ends_the_wait():
    """rank 1 fails inside the forward: its message comes back as the reply within seconds
    (default bounds), then the job ends with exit 1; the next call says the server is gone."""
    env = dict(os.environ, MESHDIT_TEST_FAIL="step:1")
    t = meshdit.Transformer.from_pretrained(FLUX, tp=2, env=env)
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    t0 = time.monotonic()
    with pytest.raises(meshdit.ServerError, match="rank 1: injected failure during step"):
        t(**args)
    assert time.monotonic() - t0 < 15
    assert t._server.proc.wait(timeout=15) not in (None, 0)
    with pytest.raises(meshdit.MeshditError, match="the server exited with status .*: meshdit: error: rank 1: "):
        t(**args)
    t.close()


def test_connect_and_close(tmp_path):
    srv = meshdit.Server(FLUX, tp=2)
    sock = srv.endpoint[len("ipc://"):]
    with meshdit.Transformer.connect(srv.endpoint) as t:
        assert t.info["tp"] == "2" and t.info["family"] == "flux"
    assert srv.client.info()["world"] == "2"  # a connected drop-in's close leaves the server
    assert srv.close() == 0 and not os.path.exists(sock)  # close request: every rank exits 0
    t0 = time.monotonic()  # a socket file that is not there: said at once, not after a timeout
    with pytest.raises(meshdit.MeshditError, match="no server at ipc://.*nobody.sock"):
        meshdit.Client("ipc://" + str(tmp_path / "nobody.sock"), timeout=30)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(meshdit.MeshditError, match="is not a socket"):
        meshdit.Transformer.connect("ipc://" + str(tmp_path / "plain"))
    assert time.monotonic() - t0 < 5
    with pytest.raises(meshdit.MeshditError, match="neither ipc"):
        meshdit.Client("udp://x")
    with pytest.raises(meshdit.MeshditError, match="no reply"):  # tcp: nobody listens
        meshdit.Client("tcp://127.0.0.1:9", timeout=0.5).info()
    with pytest.raises(meshdit.MeshditError, match="is closed"):  # use after close
        t(**tensors(os.path.join(FLUX, "inputs.safetensors")))


def test_an_interrupted_forward_leaves_no_stale_session(flux_tp2):
    """A forward that times out (or is interrupted) leaves its session in an unknown state:
    it is ended, and the next forwards send everything again and equal a fresh client's."""
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    ref = flux_tp2(**args).sample
    other = dict(args, encoder_hidden_states=args["encoder_hidden_states"] * 0.5)
    flux_tp2._client.timeout = 1e-4  # the reply cannot come in time
    with pytest.raises(meshdit.MeshditError, match="no reply"):
        flux_tp2(**other)
    flux_tp2._client.timeout = None
    assert not any(s in flux_tp2._planner.open for s in flux_tp2._stale)
    with meshdit.Transformer.connect(flux_tp2._client.endpoint, sessions=False) as plain:
        want = plain(**other).sample
    assert torch.equal(flux_tp2(**other).sample, want)
    assert torch.equal(flux_tp2(**args).sample, ref) and not torch.equal(want, ref)


def test_guidance_without_an_embedder_is_refused(tmp_path):
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    with meshdit.Transformer.from_pretrained(FLUX) as t:
        if t.config.get("guidance_embeds"):
            pytest.skip("the tiny Flux has guidance embeds")
        with pytest.raises(ValueError, match="no guidance embedding"):
            t(**args, guidance=torch.ones(1))


def test_a_dropped_server_is_stopped_without_gc():
    import gc
    gc.disable()
    try:
        srv = meshdit.Server(FLUX)
        proc = srv.proc
        del srv  # no cycle keeps it: stopped at once
        assert proc.wait(timeout=20) is not None
    finally:
        gc.enable()


def test_a_killed_owner_does_not_leave_its_server():
    code = ("import meshdit, sys, time; s = meshdit.Server(sys.argv[1], tp=2, max_sessions=7); "
            "print(s.proc.pid, flush=True); time.sleep(600)")
    py = subprocess.Popen([sys.executable, "-c", code, FLUX], stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    pid = int(py.stdout.readline())
    py.kill()
    py.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break  # ended (a zombie: its parent is gone, init reaps it)
        time.sleep(0.2)
    else:
        os.killpg(pid, 9)
        pytest.fail("the server outlived the process that started it")
    while True:  # no rank left either (they exit within seconds of the launcher's SIGTERM)
        out = subprocess.run(["pgrep", "-f", "serve --checkpoint .* --max-sessions 7"],
                             capture_output=True)
        if out.returncode == 1 or time.monotonic() - t0 > 20:
            break
        time.sleep(0.2)
    assert out.returncode == 1, out.stdout


def test_planner_keeps_one_session_when_a_small_tensor_changes():
    from meshdit._sessions import Planner
    p = Planner(4)
    big = _blob.raw(np.ones((64, 64), np.float32))
    sent = []
    for i in range(4):
        x = {"hidden_states": _blob.raw(np.full(8, i, np.float32)), "big": big,
             "idx": _blob.raw(np.array([i, i + 1]))}
        s, send, keep, ended, fps = p.plan(x, {"hidden_states"})
        p.commit(s, fps)
        sent.append(sorted(send))
        assert not ended and len(p.open) == 1
    assert sent[0] == ["big", "hidden_states", "idx"] and sent[1:] == [["hidden_states", "idx"]] * 3


def test_a_session_ended_elsewhere_is_recovered(flux_tp2):
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    a = flux_tp2(**args).sample
    for s in list(flux_tp2._planner.open):  # the server forgets them (as after a restart)
        flux_tp2._client.end_session(s)
    b = flux_tp2(**dict(args, hidden_states=args["hidden_states"].clone()))
    assert torch.equal(a, b.sample)


def test_a_request_over_the_servers_limit_is_refused_before_sending():
    """ZeroMQ would drop it without a reply: the client refuses it and the server goes on."""
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    with meshdit.Transformer.from_pretrained(FLUX, max_request_bytes="4K") as t:
        assert t._client.max_request_bytes == 4096
        with pytest.raises(meshdit.MeshditError, match="over the server's --max-request-bytes 4,096"):
            t(**args)
        assert t.info["family"] == "flux" and t._client.info()["status"] == "ok"


def test_a_killed_rank_is_named():
    """rank 1 is killed (SIGKILL) mid-forward: the wait ends with the signal, not the launcher's
    advice text."""
    env = dict(os.environ, MESHDIT_TEST_FAIL="step:1:kill")
    with meshdit.Transformer.from_pretrained(FLUX, tp=2, env=env) as t:
        t0 = time.monotonic()
        with pytest.raises(meshdit.MeshditError, match=r"a rank was killed \(signal 9"):
            t(**tensors(os.path.join(FLUX, "inputs.safetensors")))
        assert time.monotonic() - t0 < 30


# ---- sessions belong to the client that opened them (issue 26, item 3) ------------------------
def _steps(args, n=3):
    return [dict(args, hidden_states=args["hidden_states"] + 0.1 * i,
                 timestep=torch.tensor([0.9 - 0.2 * i])) for i in range(n)]


def test_two_clients_with_the_same_session_names_do_not_mix(monkeypatch):
    """Two drop-ins whose planners name their sessions alike (as two processes with one PID in
    different PID namespaces did) step through different prompts on one server, interleaved:
    each gets the outputs of its own inputs (equal to a client without sessions). Before, B's
    first forward replaced A's kept prompt and A's later steps used B's."""
    import itertools
    from meshdit import _sessions
    base = tensors(os.path.join(FLUX, "inputs.safetensors"))
    other = dict(base, encoder_hidden_states=base["encoder_hidden_states"] * 0.5 + 0.1)
    srv = meshdit.Server(FLUX, tp=2)
    try:
        with meshdit.Transformer.connect(srv.endpoint, sessions=False) as plain:
            want_a = [plain(**s).sample for s in _steps(base)]
            want_b = [plain(**s).sample for s in _steps(other)]
        got_a, got_b, clients = [], [], []
        for args, got in ((base, got_a), (other, got_b)):  # each starts as if a fresh process
            monkeypatch.setattr(_sessions, "_serial", itertools.count(1), raising=False)
            clients.append(meshdit.Transformer.connect(srv.endpoint))
            got.append(clients[-1](**_steps(args)[0]).sample)
        a, b = clients
        for sa, sb in list(zip(_steps(base), _steps(other)))[1:]:
            got_a.append(a(**sa).sample)
            got_b.append(b(**sb).sample)
        for g, w in zip(got_a, want_a):
            assert torch.equal(g, w)
        for g, w in zip(got_b, want_b):
            assert torch.equal(g, w)
        assert list(a._planner.open) == list(b._planner.open)  # the same handles...
        assert a._client._tokens != b._client._tokens  # ...behind tokens of their own
        assert a.stats["request_bytes"][-1] < a.stats["request_bytes"][0] / 5  # sessions in use
        a.close()
        b.close()
    finally:
        srv.close()


def test_an_idle_session_expires_and_the_client_recovers():
    """--session-idle 1: a session unused for 2.5 s is dropped by the server; the drop-in's next
    forward finds it gone, sends everything again and gives the same result."""
    args = tensors(os.path.join(FLUX, "inputs.safetensors"))
    with meshdit.Transformer.from_pretrained(FLUX, tp=2, session_idle=1) as t:
        assert t.info["session_idle"] == "1"
        first = t(**args).sample
        time.sleep(2.5)
        again = t(**dict(args, hidden_states=args["hidden_states"].clone())).sample
        sent = t.stats["request_bytes"]
    assert torch.equal(first, again)
    assert sent[1] >= sent[0] * 0.9, sent  # the dropped session's tensors went again
