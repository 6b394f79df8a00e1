"""Step caching against diffusers' own hook: the same pipeline, weights and seed, run with diffusers'
transformer plus `enable_cache(FirstBlockCacheConfig(...))` and with meshdit's drop-in plus the
same call, on several layouts: the same forwards skip (the pattern is asserted, and the thresholds
make some skip and some compute), the statistic agrees, and the decoded outputs agree within 1e-4.
A threshold that flips decisions changes the output (the negative control)."""
import math
import os

import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks import first_block_cache as fbc

import flux_pipeline
import meshdit
import wan_pipeline

TOL = 1e-4
LAYOUTS = [dict(), dict(tp=2, ulysses=2), dict(ring=2)]
# family: (builder, generate kwargs, steps, threshold (mixed decisions on these weights), flipped)
CASES = {
    "flux": (flux_pipeline, dict(size=64), 8, 0.5, 0.45),
    "wan": (wan_pipeline, dict(), 6, 0.1, 0.06),  # CFG: "cond" and "uncond" each decide
}


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


class Spy:
    """diffusers' decisions as its hook takes them: (branch, statistic, computes)."""

    def __init__(self):
        self.rec = []

    def __enter__(self):
        orig = self.orig = fbc.FBCHeadBlockHook._should_compute_remaining_blocks
        rec = self.rec

        def spy(hook, r):
            st = hook.state_manager.get_state()
            p = st.head_block_residual
            d = float("nan") if p is None else ((r - p).abs().mean() / p.abs().mean()).item()
            out = orig(hook, r)
            rec.append((hook.state_manager.context.name, d, bool(out)))
            return out
        fbc.FBCHeadBlockHook._should_compute_remaining_blocks = spy
        return self

    def __exit__(self, *exc):
        fbc.FBCHeadBlockHook._should_compute_remaining_blocks = self.orig


_refs = {}


def _ref(name, threshold, tmp_path_factory):
    """diffusers + its hook: (root, output, decisions), built once per (family, threshold)."""
    mod, kw, steps, _, _ = CASES[name]
    if name not in _refs:
        root = str(tmp_path_factory.mktemp(f"{name}_cache"))
        mod.build(root, seed=0)
        _refs[name] = {"root": root}
    if threshold not in _refs[name]:
        root = _refs[name]["root"]
        pipe = mod.load(root)
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        with Spy() as s:
            out = mod.generate(pipe, seed=3, steps=steps, **kw)
        _refs[name][threshold] = (out, s.rec)
    return (_refs[name]["root"], *_refs[name][threshold])


def _meshdit(name, root, threshold, layout, stats=None):
    mod, kw, steps, _, _ = CASES[name]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        pipe = mod.load(root, transformer=t)
        t.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        assert t.is_cache_enabled
        out = mod.generate(pipe, seed=3, steps=steps, **kw)
        if stats is not None:
            stats.update(t.stats)
        return out, list(t.stats["cache"])


# cfg=2 too: each branch's state on its own group, the unconditional forward computed with the
# conditional one from the second step on (Wan: CFG), the same decisions and outputs as diffusers'
@pytest.mark.parametrize("layout", LAYOUTS + [dict(cfg=2)],
                         ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
@pytest.mark.parametrize("name", CASES)
def test_first_block_cache_equals_diffusers(name, layout, tmp_path_factory):
    threshold = CASES[name][3]
    root, ref, rec = _ref(name, threshold, tmp_path_factory)
    stats = {}
    got, log = _meshdit(name, root, threshold, layout, stats)
    if layout.get("cfg") == 2:  # both branches at once where the pipeline guides
        assert stats["cfg_hits"] == (CASES[name][2] - 1 if name == "wan" else 0), stats["cfg_hits"]
    want = [(b, c) for b, _, c in rec]
    have = [(e["branch"], not e["skipped"]) for e in log]
    assert have == want, (have, want)  # the same forwards skip, branch by branch
    assert any(c for _, c in want[1:]) and not all(c for _, c in want)  # some of each
    for (_, d, _), e in zip(rec, log):  # the statistic, where there is one
        assert math.isnan(d) == math.isnan(e["diff"])
        assert math.isnan(d) or abs(d - e["diff"]) <= 1e-5 * abs(d) + 1e-7
    for e in log:  # a skip runs the first block only and says what it saved
        assert e["blocks_computed"] == 1 if e["skipped"] else e["blocks_skipped"] == 0
        assert (e["flops_saved"] > 0) == e["skipped"]
    print(f"{name} {layout}: {sum(e['skipped'] for e in log)} of {len(log)} skipped, "
          f"rel {rel(got, ref):.2e}")
    assert rel(got, ref) <= TOL


@pytest.mark.parametrize("name", CASES)
def test_a_flipped_decision_changes_the_output(name, tmp_path_factory):
    """Negative control: a threshold that makes other decisions gives another output (and still
    diffusers' decisions for that threshold)."""
    threshold, flipped = CASES[name][3], CASES[name][4]
    root, ref, rec = _ref(name, threshold, tmp_path_factory)
    _, ref2, rec2 = _ref(name, flipped, tmp_path_factory)
    assert [c for *_, c in rec2] != [c for *_, c in rec]  # the control flips decisions
    got, log = _meshdit(name, root, flipped, {})
    assert [not e["skipped"] for e in log] == [c for *_, c in rec2]
    assert rel(got, ref2) <= TOL
    assert rel(got, ref) > 10 * TOL  # the comparison above can fail (flux: 8e-3)


def test_cache_api_as_diffusers(tmp_path_factory):
    """enable_cache twice, a config meshdit does not run, a forward outside cache_context and a
    second generation (the state resets between generations, as diffusers' pipelines reset it)."""
    threshold = CASES["flux"][3]
    root, ref, _ = _ref("flux", threshold, tmp_path_factory)
    with meshdit.Transformer.from_pretrained(f"{root}/transformer") as t:
        from diffusers.hooks import PyramidAttentionBroadcastConfig
        with pytest.raises(NotImplementedError, match="PyramidAttentionBroadcastConfig"):
            t.enable_cache(PyramidAttentionBroadcastConfig())
        assert not t.is_cache_enabled
        with pytest.raises(ValueError, match="is not supported"):
            t.enable_cache(object())
        from diffusers.hooks import MagCacheConfig
        with pytest.raises(NotImplementedError, match=r"calibrate=True"):
            t.enable_cache(MagCacheConfig(calibrate=True))
        assert not t.is_cache_enabled
        t.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        with pytest.raises(ValueError, match="already been enabled"):
            t.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        x = torch.zeros(1, 16, 16)
        with pytest.raises(ValueError, match="No cache context"):
            t(hidden_states=x, encoder_hidden_states=torch.zeros(1, 4, 64),
              pooled_projections=torch.zeros(1, 32), timestep=torch.ones(1),
              img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), guidance=torch.ones(1))
        pipe = flux_pipeline.load(root, transformer=t)
        kw, steps = CASES["flux"][1], CASES["flux"][2]
        first = flux_pipeline.generate(pipe, seed=3, steps=steps, **kw)
        second = flux_pipeline.generate(pipe, seed=3, steps=steps, **kw)
        n = len(t.stats["cache"])
        assert n == 2 * steps and math.isnan(t.stats["cache"][steps]["diff"])  # a fresh state
        t.disable_cache()
        assert not t.is_cache_enabled
        plain = flux_pipeline.generate(pipe, seed=3, steps=steps, **kw)
        assert len(t.stats["cache"]) == n  # no cache: no decisions
    assert rel(first, ref) <= TOL and rel(second, ref) <= TOL
    assert rel(plain, ref) > 100 * TOL  # uncached differs from cached at this threshold


# ---- MagCache: decisions from the magnitude-ratio schedule alone (diffusers' FLUX_MAG_RATIOS,
# interpolated to the steps as MagCacheConfig does); a skip skips every block and adds the kept
# residual to the first block's input ----
def _mag_config(steps, threshold=0.06):
    from diffusers.hooks import MagCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
    return MagCacheConfig(threshold=threshold, num_inference_steps=steps, retention_ratio=0.2,
                          max_skip_steps=3, mag_ratios=FLUX_MAG_RATIOS)


class MagSpy:
    def __init__(self):
        self.rec = []

    def __enter__(self):
        from diffusers.hooks import mag_cache
        self.mod = mag_cache
        orig = self.orig = mag_cache.MagCacheHeadHook.new_forward
        rec = self.rec

        def spy(hook, module, *args, **kwargs):
            out = orig(hook, module, *args, **kwargs)
            rec.append((hook.state_manager.context.name, hook.state_manager.get_state().should_compute))
            return out
        mag_cache.MagCacheHeadHook.new_forward = spy
        return self

    def __exit__(self, *exc):
        self.mod.MagCacheHeadHook.new_forward = self.orig


_mag_refs = {}


@pytest.mark.parametrize("layout", [dict(), dict(tp=2, ulysses=2), dict(ring=2), dict(cfg=2)],
                         ids=["1rank", "tp2xulysses2", "ring2", "cfg2"])
@pytest.mark.parametrize("name,threshold", [("flux", 0.06), ("wan", 0.3)])
def test_mag_cache_equals_diffusers(name, threshold, layout, tmp_path_factory):
    mod, kw, steps, _, _ = CASES[name]
    root = _ref(name, CASES[name][3], tmp_path_factory)[0]
    if (name, threshold) not in _mag_refs:
        pipe = mod.load(root)
        with MagSpy() as s:  # the hook's forward is bound when enable_cache registers it
            pipe.transformer.enable_cache(_mag_config(steps, threshold))
            ref = mod.generate(pipe, seed=3, steps=steps, **kw)
        plain = mod.generate(mod.load(root), seed=3, steps=steps, **kw)
        _mag_refs[name, threshold] = (ref, s.rec, plain)
    ref, rec, plain = _mag_refs[name, threshold]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        pipe = mod.load(root, transformer=t)
        t.enable_cache(_mag_config(steps, threshold))
        got = mod.generate(pipe, seed=3, steps=steps, **kw)
        log = list(t.stats["cache"])
        if layout.get("cfg") == 2:
            assert t.stats["cfg_hits"] == (steps - 1 if name == "wan" else 0)
    want = [(b, c) for b, c in rec]
    have = [(e["branch"], not e["skipped"]) for e in log]
    assert have == want, (have, want)
    assert any(not c for _, c in want) and any(c for _, c in want[2:])  # skips and computes
    for e in log:
        assert e["blocks_computed"] == 0 if e["skipped"] else e["blocks_skipped"] == 0
    print(f"mag {name} {layout}: {sum(e['skipped'] for e in log)} of {len(log)} skipped, "
          f"rel {rel(got, ref):.2e}, vs uncached {rel(plain, ref):.2e}")
    assert rel(got, ref) <= TOL
    assert rel(plain, ref) > 10 * TOL  # the skips changed the output: the comparison can fail


# ---- TaylorSeer: every block's attention output predicted from Taylor factors between full steps
# (diffusers' default: interval 5 from step 3, order 1, factors kept in bfloat16) ----
class TaylorSpy:
    """diffusers' schedule, as its hooks take it: (branch, computes) per forward."""

    def __init__(self):
        self.rec = []

    def __enter__(self):
        from diffusers.hooks import taylorseer_cache as tc
        self.mod = tc
        orig = self.orig = tc.TaylorSeerCacheHook._measure_should_compute
        rec, self.seen = self.rec, set()

        def spy(hook):
            out = orig(hook)
            st = out[1]
            key = (hook.state_manager.context.name, st.current_step)
            if key not in self.seen:  # the first hooked module of the forward
                self.seen.add(key)
                rec.append((key[0], bool(out[0])))
            return out
        tc.TaylorSeerCacheHook._measure_should_compute = spy
        return self

    def __exit__(self, *exc):
        self.mod.TaylorSeerCacheHook._measure_should_compute = self.orig


def _taylor(**kw):
    return TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, max_order=1, **kw)


_ts_refs = {}


@pytest.mark.parametrize("layout", [dict(), dict(tp=2, ulysses=2), dict(ring=2)],
                         ids=["1rank", "tp2xulysses2", "ring2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_taylorseer_equals_diffusers(dtype, layout, tmp_path_factory):
    mod, kw, steps, _, _ = CASES["flux"]
    root = _ref("flux", CASES["flux"][3], tmp_path_factory)[0]
    if dtype not in _ts_refs:
        pipe = mod.load(root)
        pipe.transformer.enable_cache(_taylor(taylor_factors_dtype=dtype))
        with TaylorSpy() as s:
            ref = mod.generate(pipe, seed=3, steps=steps, **kw)
        plain = mod.generate(mod.load(root), seed=3, steps=steps, **kw)
        _ts_refs[dtype] = (ref, s.rec, plain)
    ref, rec, plain = _ts_refs[dtype]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        pipe = mod.load(root, transformer=t)
        t.enable_cache(_taylor(taylor_factors_dtype=dtype))
        got = mod.generate(pipe, seed=3, steps=steps, **kw)
        log = list(t.stats["cache"])
    assert [(e["branch"], not e["skipped"]) for e in log] == rec
    assert any(not c for _, c in rec) and any(c for _, c in rec[3:])  # predicted and computed
    print(f"taylorseer {dtype} {layout}: {sum(e['skipped'] for e in log)} of {len(log)} predicted, "
          f"rel {rel(got, ref):.2e}, vs uncached {rel(plain, ref):.2e}")
    assert rel(got, ref) <= TOL
    assert rel(plain, ref) > 10 * TOL  # the predictions changed the output: the check can fail
    other = _ts_refs.get(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
    if other is not None:  # the factors' rounding shows: meshdit rounds them as diffusers does
        print(f"  bf16 vs f32 factors: {rel(other[0], ref):.2e}")
        assert rel(other[0], ref) > 4 * rel(got, ref)


def test_taylorseer_refusals(tmp_path_factory):
    root = _ref("flux", CASES["flux"][3], tmp_path_factory)[0]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer") as t:
        with pytest.raises(NotImplementedError, match="use_lite_mode"):
            t.enable_cache(TaylorSeerCacheConfig(use_lite_mode=True))
        with pytest.raises(NotImplementedError, match="cache_identifiers"):
            t.enable_cache(TaylorSeerCacheConfig(cache_identifiers=["proj_out"]))
        assert not t.is_cache_enabled


# ---- text_kv: Wan's cross-attention K/V over the text (a generation's constant) computed once per
# branch and kept: exact, the bits of the uncached run; diffusers' TextKVCacheConfig hooks only
# NucleusMoE blocks, so on Wan its run is the uncached one too ----
@pytest.mark.parametrize("layout", [dict(), dict(tp=2, ring=2)], ids=["1rank", "tp2xring2"])
def test_text_kv_is_exact(layout, tmp_path_factory):
    from diffusers.hooks import TextKVCacheConfig
    mod, kw, steps, _, _ = CASES["wan"]
    root, _, _ = _ref("wan", CASES["wan"][3], tmp_path_factory)
    ref = mod.generate(mod.load(root), seed=3, steps=steps, **kw)  # diffusers, uncached
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        pipe = mod.load(root, transformer=t)
        plain = mod.generate(pipe, seed=3, steps=steps, **kw)
        t.enable_cache(TextKVCacheConfig())
        got = mod.generate(pipe, seed=3, steps=steps, **kw)
        log = list(t.stats["cache"])
    # each branch computes its K/V on its first forward and reuses them after
    assert [(e["branch"], e["skipped"]) for e in log[:4]] == [
        ("cond", False), ("uncond", False), ("cond", True), ("uncond", True)]
    assert all(e["skipped"] for e in log[2:]) and len(log) == 2 * steps
    assert np.array_equal(got, plain)  # exact: the uncached bits
    assert rel(got, ref) <= TOL


# ---- caches under cfg=2: each branch's state on its own group, its forward computed with the
# other branch's; a branch computed ahead and not asked for is undone ----
TRUE_CFG = dict(true_cfg_scale=2.0, negative_prompt="a blue ball")  # FLUX.1's true CFG


def _cfg_cache(cache):
    if cache == "fbc":
        return FirstBlockCacheConfig(threshold=0.5)
    if cache == "mag":
        return _mag_config(CASES["flux"][2])
    return _taylor(taylor_factors_dtype=torch.float32)


_cfg_refs = {}


@pytest.mark.parametrize("layout", [dict(cfg=2), dict(cfg=2, ulysses=2)],
                         ids=["cfg2", "cfg2xulysses2"])
@pytest.mark.parametrize("cache", ["fbc", "mag", "taylorseer"])
def test_caches_under_cfg2_equal_diffusers(cache, layout, tmp_path_factory):
    """FLUX.1 with true CFG: diffusers' pipeline + its hook against meshdit's cfg=2 + the same
    hook: the outputs within 1e-4, the decisions those of one rank, and the unconditional forward
    of every step but the first computed with the conditional one (cfg_hits = steps - 1); in a
    second generation every step's (the pair is known), with the same result."""
    mod, kw, steps, _, _ = CASES["flux"]
    root = _ref("flux", CASES["flux"][3], tmp_path_factory)[0]
    if cache not in _cfg_refs:
        pipe = mod.load(root)
        pipe.transformer.enable_cache(_cfg_cache(cache))
        ref = mod.generate(pipe, seed=3, steps=steps, **kw, **TRUE_CFG)
        with meshdit.Transformer.from_pretrained(f"{root}/transformer") as t:
            t.enable_cache(_cfg_cache(cache))
            one = mod.generate(mod.load(root, transformer=t), seed=3, steps=steps, **kw, **TRUE_CFG)
            _cfg_refs[cache] = (ref, one, list(t.stats["cache"]))
    ref, one, log1 = _cfg_refs[cache]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        t.enable_cache(_cfg_cache(cache))
        pipe = mod.load(root, transformer=t)
        got = mod.generate(pipe, seed=3, steps=steps, **kw, **TRUE_CFG)
        log, hits = list(t.stats["cache"]), t.stats["cfg_hits"]
        # a second generation: the pair is known from the first, so its first step hits too
        # (the new generation's uncond branch made with the concurrent forward), same result
        again = mod.generate(pipe, seed=3, steps=steps, **kw, **TRUE_CFG)
        assert t.stats["cfg_hits"] - hits == steps
        assert np.array_equal(again, got)
        assert [(e["branch"], e["skipped"]) for e in t.stats["cache"][len(log):]] == [
            (e["branch"], e["skipped"]) for e in log]
    dec = [(e["branch"], e["skipped"]) for e in log]
    assert dec == [(e["branch"], e["skipped"]) for e in log1]
    assert {b for b, _ in dec} == {"cond", "uncond"}
    assert any(s for _, s in dec) and not all(s for _, s in dec[2:])  # some of each
    print(f"{cache} {layout}: {sum(s for _, s in dec)} of {len(dec)} skipped, {hits} hits, "
          f"rel {rel(got, ref):.2e} (one rank {rel(one, ref):.2e})")
    assert hits == steps - 1
    assert rel(got, ref) <= TOL and rel(got, one) <= 1e-5


def _tiny_branches():
    """flux_tiny's checkpoint, its inputs and an unconditional set (other text, pooled negated)."""
    from safetensors.torch import load_file
    case = os.path.join(os.path.dirname(__file__), "..", "data", "flux_tiny")
    x = load_file(f"{case}/inputs.safetensors")
    neg = dict(x, encoder_hidden_states=x["encoder_hidden_states"].flip(1),
               pooled_projections=-x["pooled_projections"])
    return case, x, neg


def _call(t, branch, inp, outs):
    """One forward of the drop-in in cache context `branch`, its sample appended to outs."""
    with t.cache_context(branch):
        outs.append(t(**inp, return_dict=False)[0].numpy())


@pytest.mark.parametrize("cache", ["fbc", "taylorseer"])
def test_cfg2_undoes_a_branch_computed_ahead(cache):
    """Negative control: after the branches are paired, an unconditional call whose latents
    differ from the conditional call's is computed for its own inputs from the state before
    the concurrent forward (which is undone); every call's output and decision equals the same
    calls on one rank, and the steps after it pair again."""
    case, x, neg = _tiny_branches()
    config = (FirstBlockCacheConfig(threshold=0.03) if cache == "fbc"
              else TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                         taylor_factors_dtype=torch.float32))

    def run(**layout):
        outs = []
        with meshdit.Transformer.from_pretrained(case, **layout) as t, torch.no_grad():
            t.enable_cache(config)
            for step in range(6):
                hs = x["hidden_states"] * (1 - 0.03 * step)
                uh = hs + 0.5 if step == 3 else hs  # step 3: other latents for the other branch
                _call(t, "cond", dict(x, hidden_states=hs), outs)
                _call(t, "uncond", dict(neg, hidden_states=uh), outs)
            return outs, list(t.stats["cache"]), t.stats["cfg_hits"]

    one, log1, _ = run()
    two, log2, hits = run(cfg=2)
    assert hits == 4  # steps 1, 2, 4, 5: the first has no pair, the third other latents
    dec = [(e["branch"], e["skipped"]) for e in log1]
    assert any(s for _, s in dec) and not all(s for _, s in dec[2:])
    assert [(e["branch"], e["skipped"]) for e in log2] == dec
    for a, b in zip(log2, log1):  # the statistic too: a kept stray forward would move it
        assert math.isnan(a["diff"]) == math.isnan(b["diff"])
        assert math.isnan(a["diff"]) or a["diff"] == b["diff"]
    for a, b in zip(two, one):
        assert np.array_equal(a, b)


def test_cfg2_a_restarted_generation_is_not_answered_from_the_old_one():
    """A generation ended while the other branch was computed ahead, then started again under
    the same name: the unconditional call with the speculated inputs is a fresh generation's
    first forward (computed, no statistic), as on one rank, not the old generation's answer."""
    case, x, neg = _tiny_branches()

    def run(**layout):
        outs = []
        with meshdit.Transformer.from_pretrained(case, **layout) as t, torch.no_grad():
            t.enable_cache(FirstBlockCacheConfig(threshold=0.03))
            for step in range(3):
                hs = x["hidden_states"] * (1 - 0.03 * step)
                _call(t, "cond", dict(x, hidden_states=hs), outs)
                if step == 2:  # the server computed uncond with this cond: end, reuse the name
                    t._client.end_cache_generation(t._cache_gen)
                _call(t, "uncond", dict(neg, hidden_states=hs), outs)
            return outs, list(t.stats["cache"]), t.stats["cfg_hits"]

    one, log1, _ = run()
    two, log2, hits = run(cfg=2)
    assert math.isnan(log1[-1]["diff"]) and not log1[-1]["skipped"]  # a fresh state's first
    assert hits == 1  # step 1 only: step 2's uncond belongs to the new generation
    dec = [(e["branch"], e["skipped"]) for e in log1]
    assert [(e["branch"], e["skipped"]) for e in log2] == dec
    assert math.isnan(log2[-1]["diff"])
    for a, b in zip(two, one):
        assert np.array_equal(a, b)
