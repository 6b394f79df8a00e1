"""The drop-in's cache configs as a hostile user meets them: a cache error is raised (never
answered by sending everything again without the session), a refused second enable_cache leaves
the first one running, a step count that is not a whole number is refused (diffusers computes
with 2.5 as 2.5; int() would run 2), and a config changed after enable_cache is refused at the
next forward before anything is sent (diffusers' hooks read the changed object; the spec taken
at enable_cache would not). One tiny Flux checkpoint on one rank, shared by the tests."""
import os

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from safetensors.torch import load_file

import meshdit
from meshdit.client import ServerError
from meshdit.transformer import _cache_spec, _to_raw

FLUX = os.path.join(os.path.dirname(__file__), "..", "data", "flux_tiny")
X = load_file(os.path.join(FLUX, "inputs.safetensors"))


def step(i):
    """The inputs of step i: the constants of X, the latents and timestep of that step."""
    return dict(X, hidden_states=X["hidden_states"] * (1 - 0.03 * i),
                timestep=X["timestep"] * (1 - 0.1 * i))


def call(t, i, branch="cond"):
    with t.cache_context(branch), torch.no_grad():
        return t(**step(i), return_dict=False)[0]


@pytest.fixture(scope="module")
def mesh():
    with meshdit.Transformer.from_pretrained(FLUX) as t:
        yield t


@pytest.fixture
def t(mesh, monkeypatch):
    """The shared transformer with no cache, its client's forward requests recorded in
    t.sent as (names sent, session handle)."""
    if mesh.is_cache_enabled:
        mesh.disable_cache()
    mesh.sent = []
    orig = mesh._client.forward

    def spy(tensors, **kw):
        mesh.sent.append((sorted(tensors), kw.get("session")))
        return orig(tensors, **kw)
    monkeypatch.setattr(mesh._client, "forward", spy)
    yield mesh
    if mesh.is_cache_enabled:
        mesh.disable_cache()


# ---- 1. an error reply is resent without the session only when the session lost tensors ------
def test_a_cache_error_is_raised_not_resent(t):
    """A session holds the constants, so the TaylorSeer forward sends only the latents: its cache
    error (diffusers: "Cannot predict without prior initialization") is raised from that one
    request, on the first forward and on a repeat, as diffusers raises it."""
    config = dict(cache_interval=2, disable_cache_before_step=0)
    ref = FluxTransformer2DModel.from_pretrained(FLUX)
    ref.enable_cache(TaylorSeerCacheConfig(**config))
    with pytest.raises(ValueError, match="Cannot predict without prior initialization"):
        call(ref, 0)

    call(t, 0)  # the session now holds the constants
    t.enable_cache(TaylorSeerCacheConfig(**config))
    for attempt in range(2):
        del t.sent[:]
        with pytest.raises(ServerError, match="TaylorSeer would predict step 0"):
            call(t, attempt + 1)
        assert len(t.sent) == 1, t.sent  # no second request without the session
        if attempt == 0:  # the case at issue: only part of the inputs were sent
            assert t.sent[0][0] == ["hidden_states", "timestep"]
    t.disable_cache()
    assert torch.equal(call(t, 5), call(t, 5))  # the transformer goes on


def test_a_session_the_server_dropped_is_resent(t):
    """The server ended the session behind the client's back (its token is still held): the
    forward's `session 'H' is not open` is answered by sending everything again."""
    want = call(t, 1)
    session = t.sent[-1][1]
    t._client.request({"op": "end_session", "session": t._client._tokens[session]})
    del t.sent[:]
    assert torch.equal(call(t, 1), want)
    assert t.sent[0] == (["hidden_states", "timestep"], session)  # the constants from the session
    assert t.sent[1] == (sorted(X), None)  # then everything, without it


def test_a_session_missing_a_tensor_is_resent(t):
    """The session is open but lacks a tensor the planner has it hold: the model's
    `inputs: tensor 'txt_ids' is missing` is answered by sending everything again."""
    want = call(t, 2)
    session = t.sent[-1][1]
    client = t._client
    client.request({"op": "end_session", "session": client._tokens.pop(session)})
    part = ["encoder_hidden_states", "pooled_projections", "img_ids"]  # not txt_ids
    client.forward({n: _to_raw(n, v) for n, v in step(2).items()}, session=session, keep=part)
    del t.sent[:]
    assert torch.equal(call(t, 2), want)
    assert [s for _, s in t.sent] == [session, None]


# ---- 2. a refused enable_cache keeps the active config --------------------------------------
def test_a_refused_second_enable_cache_keeps_the_first(t):
    """FBC(0.0) computes every step; the refused FBC(100.0) would skip every step after the
    first. The forwards after the refusal run 0.0: every block, the uncached outputs."""
    plain = [call(t, i) for i in range(3)]
    t.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    with pytest.raises(ValueError, match="already been enabled"):
        t.enable_cache(FirstBlockCacheConfig(threshold=100.0))
    del t.stats["cache"][:]
    got = [call(t, i) for i in range(3)]
    assert [c["skipped"] for c in t.stats["cache"]] == [False] * 3
    for a, b in zip(got, plain):
        assert torch.equal(a, b)


# ---- 3. step counts are whole numbers ---------------------------------------------------------
def _mag():
    return MagCacheConfig(threshold=0.06, num_inference_steps=4, retention_ratio=0.2,
                          mag_ratios=[1.0, 0.95, 1.05, 1.0])


def _taylor():
    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)


WHOLE = [(_taylor, "cache_interval"), (_taylor, "disable_cache_before_step"),
         (_taylor, "disable_cache_after_step"), (_taylor, "max_order"),
         (_mag, "max_skip_steps"), (_mag, "num_inference_steps")]


@pytest.mark.parametrize("make,field", WHOLE)
@pytest.mark.parametrize("value", [2.5, "2", True])
def test_a_step_count_that_is_not_a_whole_number_is_refused(t, make, field, value):
    config = make()
    setattr(config, field, value)
    name = type(config).__name__
    with pytest.raises(NotImplementedError, match=rf"{name}\.{field}={value!r} is not "
                                                  rf"implemented \(meshdit takes whole numbers\)"):
        t.enable_cache(config)
    assert not t.is_cache_enabled


@pytest.mark.parametrize("make,field", WHOLE)
def test_a_whole_float_is_taken_as_its_int(make, field):
    a, b = make(), make()
    setattr(a, field, 3)
    setattr(b, field, 3.0)
    assert _cache_spec(a) == _cache_spec(b)


# ---- 4. a config changed after enable_cache is refused --------------------------------------
@pytest.mark.parametrize("make,field,value", [
    (lambda: FirstBlockCacheConfig(threshold=0.0), "threshold", 100.0),
    (_mag, "threshold", 100.0),
    (_taylor, "cache_interval", 3),
])
def test_a_config_changed_after_enable_cache_is_refused(t, make, field, value):
    """diffusers would run the changed field from the next forward on; meshdit refuses that
    forward before sending anything, and runs again once the config is as it was enabled."""
    config = make()
    t.enable_cache(config)
    call(t, 0)
    was = getattr(config, field)
    setattr(config, field, value)
    del t.sent[:]
    with pytest.raises(ValueError, match=rf"the {type(config).__name__} given to enable_cache "
                                         rf"was changed after enable_cache; call disable_cache"):
        call(t, 1)
    assert t.sent == []
    setattr(config, field, was)
    call(t, 1)
    t.disable_cache()
    setattr(config, field, value)
    t.enable_cache(config)  # enabled again: the changed config runs
    call(t, 0)


# ---- 4. what the server refuses, refused by enable_cache, not by every forward after it ------
@pytest.mark.parametrize("make,why", [
    (lambda: TaylorSeerCacheConfig(cache_interval=0), r"cache_interval=0 is not in \[1, "),
    (lambda: TaylorSeerCacheConfig(max_order=9), r"max_order=9 is not in \[0, 4\]"),
    (lambda: TaylorSeerCacheConfig(disable_cache_before_step=-(1 << 21)), "is not in"),
    (lambda: MagCacheConfig(mag_ratios=[float("nan"), 1.0]), "finite numbers"),
    (lambda: MagCacheConfig(mag_ratios=[1.0, 0.9], retention_ratio=-1.0), "retention_ratio"),
    (lambda: MagCacheConfig(mag_ratios=[1.0, 0.9], max_skip_steps=-1), "max_skip_steps=-1"),
])
def test_values_the_server_refuses_are_refused_at_enable_cache(t, make, why):
    with pytest.raises(ValueError, match=why):
        t.enable_cache(make())
    assert not t.is_cache_enabled and not t.sent  # nothing enabled, nothing sent


def test_a_cache_the_family_does_not_run_is_refused_at_enable_cache(t):
    """text_kv is Wan's (its cross-attention): on Flux every forward failed after it."""
    from diffusers.hooks import TextKVCacheConfig
    with pytest.raises(NotImplementedError, match="TextKVCacheConfig is not implemented for "
                                                  "FluxTransformer2DModel"):
        t.enable_cache(TextKVCacheConfig())
    assert not t.is_cache_enabled
    call(t, 0)  # the transformer goes on, uncached
