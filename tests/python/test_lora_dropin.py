"""diffusers' LoRA API on the drop-in, against diffusers + peft on the same weights.

The drop-in keeps peft's own adapter state (meshdit/_lora.py: a peft layer, a probe, per group
of the layers the adapters target) and each forward fuses on the mesh what that state says. So
every call of diffusers' API is checked the only way that proves it: the same calls on
diffusers' own transformer (with peft) and on the drop-in, a forward after each, the outputs
within 1e-4 — a fixed sequence on one rank, tp=2 and tp=2 x ulysses=2, random sequences of
every call (seeded), adapters on different layers (fused, disabled, deleted while others act:
peft answers per layer), layers emptied by delete_adapters and disabled, which keep a later
adapter disabled until unload_lora, a loop of fuses of different subsets (the server's adapter
count bounded), the four families' adapters, and a real FluxPipeline's
``load_lora_weights`` / ``set_adapters`` / ``fuse_lora`` / ``unfuse_lora`` /
``unload_lora_weights``. Where no adapter acts the drop-in's output is its base output bit for
bit; a LoRA on one layer changes it (negative control); a second client of the same server
runs without the first one's adapters; bad adapters are refused naming what is wrong, and
nothing changes.
"""
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import meshdit
from meshdit.client import ServerError
from meshdit._lora import family_lora_state_dict
from test_lora import DATA, LAYOUTS, TOL, _families, kohya_flux, rel

LAYOUT_KW = [dict(), dict(tp=2), dict(tp=2, ulysses=2)]
IDS = [i for i in ("1rank", "tp2", "tp2xulysses2")]
assert len(LAYOUT_KW) == len(LAYOUTS)


def flux_adapters():
    """Three Flux adapters as diffusers' pipeline hands them to load_lora_adapter: kohya names
    converted (alphas baked), the goldens' diffusers file with metadata, and one with alphas."""
    k = family_lora_state_dict("flux", kohya_flux(seed=5))
    a = family_lora_state_dict("flux", f"{DATA}/lora/flux_tiny/a.safetensors")
    b = family_lora_state_dict("flux", f"{DATA}/lora/flux_tiny/b.safetensors")
    return {"k": k, "a": a, "b": b}


def load(m, adapters, src, name):
    sd, alphas, meta = adapters[src]
    m.load_lora_adapter(dict(sd), prefix="transformer", adapter_name=name,
                        network_alphas=alphas or None, metadata=meta or None)


def reference(case="flux_tiny"):
    return _families()[case.split("_")[0]][1].from_pretrained(
        f"{DATA}/{case}", torch_dtype=torch.float32).eval()


def out(m, inputs, scale=None):
    kw = {} if scale is None else {"joint_attention_kwargs": {"scale": scale}}
    with torch.no_grad():
        return m(**inputs, **kw, return_dict=False)[0].numpy()


@pytest.fixture(scope="module")
def adapters():
    return flux_adapters()


def part(adapter, keep):
    """An adapter on the modules `keep` accepts only (its factors and alphas there), as a pipeline
    hands over one trained on those layers."""
    sd, alphas, meta = adapter
    mod = lambda k: k.rsplit(".lora_", 1)[0].removesuffix(".alpha")  # noqa: E731
    return ({k: v for k, v in sd.items() if keep(mod(k))},
            {k: v for k, v in (alphas or {}).items() if keep(mod(k))}, meta)


@pytest.fixture(scope="module")
def layered(adapters):
    """Adapters on different layers: the goldens' `a` (metadata, 28 modules) cut into its
    attention layers and the others (disjoint), beside `b` (alphas as keys: 6 attention layers,
    overlapping `attn` in part) and `k` (kohya: 16 layers of the first double block)."""
    attn = lambda m: ".attn." in m  # noqa: E731
    return {**adapters, "attn": part(adapters["a"], attn),
            "mlp": part(adapters["a"], lambda m: not attn(m))}


@pytest.fixture(scope="module")
def inputs():
    return load_file(f"{DATA}/flux_tiny/inputs.safetensors")


@pytest.mark.parametrize("layout", LAYOUT_KW, ids=IDS)
def test_the_calls_in_turn(adapters, inputs, layout):
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny", **layout) as t:
        base = out(t, inputs)
        assert rel(base, out(ref, inputs)) <= TOL

        def same(what, scale=None, changed=True):
            want, got = out(ref, inputs, scale), out(t, inputs, scale)
            assert rel(got, want) <= TOL, what
            if changed:
                assert rel(got, base) > 100 * TOL, f"{what}: the adapters did nothing"
            if getattr(ref, "peft_config", None):
                assert t.active_adapters() == ref.active_adapters(), what
            return got

        for m in (ref, t):
            load(m, adapters, "k", "k")
        same("load k")
        for m in (ref, t):
            load(m, adapters, "a", "a")
        same("load a (peft makes the new one active)")
        for m in (ref, t):
            m.set_adapters(["k", "a"], [0.7, -1.3])
        two = same("set_adapters two with weights")
        same("the attention kwargs' scale", scale=0.4)
        assert np.array_equal(out(t, inputs), two)  # the scale was for that forward only
        for m in (ref, t):
            m.fuse_lora(lora_scale=0.8, adapter_names=["a"])
        same("fuse_lora one of two")
        for m in (ref, t):
            m.unfuse_lora()
        same("unfuse_lora")
        for m in (ref, t):
            m.disable_lora()
        assert np.array_equal(out(t, inputs), base)  # disabled: the base weights, bit for bit
        same("disable_lora", changed=False)
        for m in (ref, t):
            m.enable_lora()
        same("enable_lora")
        for m in (ref, t):
            m.set_adapters(["k", "a"], [0.0, 0.0])
        assert np.array_equal(out(t, inputs), base)  # weight 0: the base bits
        for m in (ref, t):
            m.set_adapters(["k"], [1.0])
            m.delete_adapters(["a"])
        same("delete_adapters")
        assert sorted(t.peft_config) == sorted(ref.peft_config) == ["k"]
        for m in (ref, t):
            m.fuse_lora()
            m.unload_lora()
        same("fuse_lora then unload_lora: the fused weights stay (as in diffusers)")
        assert not hasattr(t, "peft_config")
        for m in (ref, t):
            load(m, adapters, "b", "b")
            m.set_adapters(["b"], [0.0])
        same("an adapter at 0 over what unload kept")


def test_unload_gives_back_the_base_bits(adapters, inputs):
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny") as t:
        base = out(t, inputs)
        load(t, adapters, "k", "k")
        load(t, adapters, "b", "b")
        t.set_adapters(["k", "b"], [1.0, 0.5])
        assert rel(out(t, inputs), base) > 100 * TOL
        t.unload_lora()
        assert np.array_equal(out(t, inputs), base)
        assert list(t.modules()) == [t]  # no probe left: the drop-in as before any adapter
        load(t, adapters, "k", "again")  # the same name space again
        assert t.active_adapters() == ["again"]


def test_one_layer_changes_the_output(inputs):
    """Negative control: a LoRA on one linear of one block moves the output; the same adapter
    with B = 0 does not (bit for bit)."""
    g = torch.Generator().manual_seed(3)
    key = "transformer.single_transformer_blocks.0.proj_out"
    sd = {f"{key}.lora_A.weight": torch.randn(2, 160, generator=g),
          f"{key}.lora_B.weight": torch.randn(32, 2, generator=g)}
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny", tp=2) as t:
        base = out(t, inputs)
        for m in (ref, t):
            m.load_lora_adapter(dict(sd), adapter_name="one")
        got = out(t, inputs)
        assert rel(got, out(ref, inputs)) <= TOL and rel(got, base) > 100 * TOL
        t.load_lora_adapter({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in sd.items()},
                            adapter_name="zero")
        t.set_adapters(["zero"])
        assert np.array_equal(out(t, inputs), base)


OPS = ("load", "set_adapters", "set_adapter", "fuse", "unfuse", "disable", "enable", "delete",
       "unload", "scale")


def _random_op(rnd, m, names, op):
    """Applies one call to `m`; returns (the forward's scale, the exception's type or None)."""
    scale = None
    try:
        if op == "set_adapters":
            pick = rnd.sample(names, rnd.randint(1, len(names))) if names else ["nope"]
            m.set_adapters(pick, [rnd.choice([0.0, 0.5, -1.0, 1.7]) for _ in pick])
        elif op == "set_adapter":
            m.set_adapter(rnd.choice(names) if names else "nope")
        elif op == "fuse":
            m.fuse_lora(lora_scale=rnd.choice([1.0, 0.5, 2.0]),
                        adapter_names=rnd.choice([None, names[:1]]) if names else None)
        elif op == "unfuse":
            m.unfuse_lora()
        elif op == "disable":
            m.disable_lora()
        elif op == "enable":
            m.enable_lora()
        elif op == "delete":
            m.delete_adapters(rnd.choice(names) if names else "nope")
        elif op == "unload":
            m.unload_lora()
        elif op == "scale":
            scale = rnd.choice([0.0, 0.25, 3.0])
    except Exception as e:  # noqa: BLE001 - both sides must fail alike
        return scale, type(e)
    return scale, None


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_random_sequences_match_diffusers(layered, inputs, seed):
    """Random sequences of every call (seeded), on both sides, over adapters on different layers
    (disjoint, overlapping, nested: peft's state is per layer); after each, a forward within
    1e-4, the same active adapters and adapter list, and the same failures."""
    adapters = layered
    rnd = random.Random(seed)
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny", tp=1 + seed % 2) as t:
        n = 0
        for step in range(24):
            names = sorted(getattr(ref, "peft_config", None) or {})
            op = rnd.choice(OPS) if names or step else "load"
            if op == "load":
                src, n = rnd.choice(sorted(adapters)), n + 1
                for m in (ref, t):
                    load(m, adapters, src, f"x{n}")
                scale, err = None, None
            else:
                r = rnd.getstate()
                scale, err = _random_op(rnd, ref, names, op)
                rnd.setstate(r)
                scale2, err2 = _random_op(rnd, t, names, op)
                assert (scale, err) == (scale2, err2), f"step {step} {op}"
            what = f"seed {seed} step {step} {op} -> {err}"
            assert rel(out(t, inputs, scale), out(ref, inputs, scale)) <= TOL, what
            assert sorted(getattr(t, "peft_config", None) or {}) == sorted(
                getattr(ref, "peft_config", None) or {}), what
            if getattr(ref, "peft_config", None):
                assert t.active_adapters() == ref.active_adapters(), what


def _both(ref, t, inputs, what, call):
    """`call` on diffusers' transformer and on the drop-in; their outputs agree without a scale
    and at 0.5. Returns the drop-in's output at 0.5."""
    for m in (ref, t):
        call(m)
    for scale in (None, 0.5):
        got = out(t, inputs, scale)
        assert rel(got, out(ref, inputs, scale)) <= TOL, f"{what} (scale {scale})"
    return got


@pytest.mark.parametrize("x,y", [("attn", "mlp"), ("b", "attn"), ("k", "b")],
                         ids=["disjoint", "overlapping", "alphas-inside"])
def test_fusing_one_of_adapters_on_different_layers(layered, inputs, x, y):
    """peft's state is per layer: a layer holds the adapters that target it, and one with an
    adapter merged skips its unmerged ones. So after fuse_lora(adapter_names=[x]), y still acts
    in the layers x does not reach (all of its layers when they are disjoint): the same calls on
    diffusers and on the drop-in, within 1e-4 after each (the drop-in keeps a peft layer per
    group of layers and sends an adapter whose groups differ as its parts)."""
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny") as t:
        base = out(t, inputs)
        calls = [
            ("load both", lambda m: (load(m, layered, x, "x"), load(m, layered, y, "y"))),
            ("set_adapters both", lambda m: m.set_adapters(["x", "y"], [0.8, 1.3])),
            ("fuse x of the two", lambda m: m.fuse_lora(adapter_names=["x"])),
            ("disable_lora with x fused (peft unmerges it)", lambda m: m.disable_lora()),
            ("enable_lora", lambda m: m.enable_lora()),
            ("set_adapters y with x fused", lambda m: m.set_adapters(["y"], [-0.6])),
            ("unfuse_lora", lambda m: m.unfuse_lora()),
            ("x alone, fused", lambda m: (m.set_adapters(["x"]), m.fuse_lora(adapter_names=["x"]))),
            ("then set_adapters y", lambda m: m.set_adapters(["y"])),
            ("unfuse, fuse y scaled", lambda m: (m.unfuse_lora(), m.set_adapters(["x", "y"]),
                                                 m.fuse_lora(0.7, adapter_names=["y"]))),
            ("delete_adapters y (fused: it stays)", lambda m: m.delete_adapters("y")),
            ("load y again beside fused y", lambda m: load(m, layered, y, "y2")),
            ("unload_lora", lambda m: m.unload_lora()),
        ]
        for what, call in calls:
            got = _both(ref, t, inputs, what, call)
            if what.startswith("disable_lora"):
                assert np.array_equal(got, base), what
            else:
                assert rel(got, base) > 100 * TOL, f"{what}: the adapters did nothing"
            if getattr(ref, "peft_config", None):
                assert t.active_adapters() == ref.active_adapters(), what
        assert not hasattr(t, "peft_config")


def test_deleting_the_only_active_adapter_activates_one_per_layer(layered, inputs):
    """delete_adapters of the only active adapter makes each peft layer activate the first
    (sorted) adapter it holds: `p` in the attention layers, `q` in the others here (both from
    then on), and active_adapters() answers from the model's first LoRA layer; the drop-in gives
    diffusers' output and answer after each call."""
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny", tp=2) as t:
        calls = [
            ("load p, q and r over both", lambda m: [load(m, layered, src, name) for src, name
                                                    in (("attn", "p"), ("mlp", "q"), ("a", "r"))]),
            ("delete r, the only active one", lambda m: m.delete_adapters("r")),
            ("set_adapters p and q", lambda m: m.set_adapters(["p", "q"], [0.5, 2.0])),
            ("fuse p, delete p", lambda m: (m.fuse_lora(adapter_names=["p"]),
                                            m.delete_adapters("p"))),
            ("load r again: active alone", lambda m: load(m, layered, "a", "r")),
            ("delete r, p fused and gone", lambda m: m.delete_adapters("r")),
        ]
        for what, call in calls:
            for m in (ref, t):
                call(m)
            assert rel(out(t, inputs), out(ref, inputs)) <= TOL, what
            assert t.active_adapters() == ref.active_adapters(), what
            assert sorted(t.peft_config) == sorted(ref.peft_config), what


def _lora_layers(m) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer
    return any(isinstance(x, BaseTunerLayer) for x in m.modules())


def _answer(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - both sides must fail alike
        return type(e)


@pytest.mark.parametrize("tp", [1, 2], ids=["1rank", "tp2"])
def test_layers_left_empty_stay_until_unload_lora(layered, inputs, tp):
    """diffusers' delete_adapters leaves an adapter's LoRA layers in the model (holding nothing)
    and disable_lora marks them disabled; an adapter injected into a disabled layer does not act
    there. Only unload_lora takes the layers out. So the drop-in keeps a probe exactly as long as
    diffusers keeps the layers it stands for, also once every adapter is deleted: the same
    calls on both, within 1e-4 after each, the same active_adapters() answer, and a LoRA layer
    in the drop-in exactly when diffusers' model has one (after unload_lora: none, the drop-in
    module-free; a new adapter then gets fresh layers)."""
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny", tp=tp) as t:
        base = out(t, inputs)
        calls = [
            ("load a as x1", lambda m: load(m, layered, "a", "x1")),
            ("delete x1, the last adapter: its layers stay", lambda m: m.delete_adapters("x1")),
            ("disable_lora marks those empty layers", lambda m: m.disable_lora()),
            ("load attn into the disabled layers: it does not act",
             lambda m: load(m, layered, "attn", "x2")),
            ("enable_lora", lambda m: m.enable_lora()),
            ("delete x2", lambda m: m.delete_adapters("x2")),
            ("load b, delete it, load k", lambda m: (load(m, layered, "b", "x3"),
                                                     m.delete_adapters("x3"),
                                                     load(m, layered, "k", "x4"))),
            ("disable_lora, delete k", lambda m: (m.disable_lora(), m.delete_adapters("x4"))),
            ("load a: disabled in every layer it reaches",
             lambda m: load(m, layered, "a", "x5")),
            ("set_adapters x5 while disabled", lambda m: m.set_adapters(["x5"], [0.5])),
            ("enable_lora", lambda m: m.enable_lora()),
            ("delete x5, disable", lambda m: (m.delete_adapters("x5"), m.disable_lora())),
            ("unload_lora: the layers go", lambda m: m.unload_lora()),
            ("load attn into fresh layers: it acts", lambda m: load(m, layered, "attn", "x6")),
            ("fuse, unload: the merged weights stay",
             lambda m: (m.fuse_lora(adapter_names=["x6"]), m.unload_lora())),
            ("load mlp beside what unload kept", lambda m: load(m, layered, "mlp", "x7")),
        ]
        for what, call in calls:
            got = _both(ref, t, inputs, what, call)
            assert sorted(getattr(t, "peft_config", None) or {}) == sorted(
                getattr(ref, "peft_config", None) or {}), what
            assert _answer(t.active_adapters) == _answer(ref.active_adapters), what
            assert _lora_layers(t) == _lora_layers(ref), what
            if what.startswith("unload_lora"):
                assert list(t.modules()) == [t], what  # nothing merged: no probe left
                assert np.array_equal(got, base), what
        for m in (ref, t):
            m.unload_lora()
        assert rel(out(t, inputs), out(ref, inputs)) <= TOL
        assert len(list(t.modules())) == 2  # the probe of the layers that keep x6's merge


def test_fusing_subsets_keeps_the_servers_adapters_bounded(adapters, inputs):
    """fuse_lora(adapter_names=SUBSET) of adapters on single layers inside a larger one makes
    the larger one act in the layers no fused adapter holds: the drop-in sends it as a part on
    those modules, a sub-adapter on the server, one per distinct subset. It keeps only the parts
    of this forward and of the one before (fused on the server now), so after every forward of a
    loop over subsets the server holds the drop-in's adapters plus at most two parts, and every
    forward is diffusers' within 1e-4. When the server refuses a part (its 64-adapter limit, all
    clients together) the error is one line naming the user's adapter, and the drop-in works
    again once there is room."""
    sd, alphas, meta = adapters["a"]
    mods = sorted({k.rsplit(".lora_", 1)[0] for k in sd})[:6]
    singles = {f"s{i}": part(adapters["a"], lambda x, m=m: x == m) for i, m in enumerate(mods)}
    assert all(s[0] for s in singles.values())
    pool = {**adapters, **singles}
    names = ["A", *singles]
    ref = reference()
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny") as t:
        loaded = lambda: int(t._client.info()["adapters_loaded"])  # noqa: E731
        for m in (ref, t):
            load(m, pool, "a", "A")
            for s in singles:
                load(m, pool, s, s)
        assert loaded() == len(names)
        rnd = random.Random(0)
        most = 0
        for it in range(12):
            subset = sorted(rnd.sample(sorted(singles), rnd.randint(1, 3)))
            for m in (ref, t):
                m.unfuse_lora()
                m.set_adapters(names, [1.0] + [0.5] * len(singles))
                m.fuse_lora(adapter_names=subset)
            for scale in (None, 0.5):
                assert rel(out(t, inputs, scale), out(ref, inputs, scale)) <= TOL, (it, subset)
                most = max(most, loaded())
                assert loaded() <= len(names) + 2, (it, subset, loaded())
        assert most > len(names)  # the loop did send parts
        # the server's limit reached (by another client, say) while a part is needed
        st = t.__dict__["_meshdit_lora"]
        fill = [f"other{i}" for i in range(64 - loaded())]
        small = pool["s0"]
        from meshdit._lora import adapter_parts
        for name in fill:
            t._client.lora_load(name, *adapter_parts(*small))
        for m in (ref, t):
            m.unfuse_lora()
            m.fuse_lora(adapter_names=["s0", "s1", "s2", "s3"])  # a subset the loop never drew
        with pytest.raises(ServerError) as e:
            out(t, inputs)
        msg = str(e.value)
        assert "\n" not in msg and "adapter 'A'" in msg and "64 adapters" in msg, msg
        assert st["prefix"] not in msg and "lora_load: lora_load" not in msg, msg
        for name in fill:
            t._client.lora_unload(name)
        assert rel(out(t, inputs), out(ref, inputs)) <= TOL
        assert loaded() <= len(names) + 2
        for m in (ref, t):
            m.unfuse_lora()
            m.unload_lora()
        assert rel(out(t, inputs), out(ref, inputs)) <= TOL
        assert loaded() == 0 and list(t.modules()) == [t]


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage", "wan"])
def test_every_family_through_load_lora_adapter(tmp_path, family):
    """The goldens' two adapters per family through the drop-in's load_lora_adapter and
    set_adapters (0.7, -1.3): diffusers + peft's output (scripts/goldens_lora.py)."""
    case = _families()[family][0]
    want = load_file(f"{DATA}/lora/{case}/expected_ab.safetensors")["sample"].numpy()
    x = load_file(f"{DATA}/{case}/inputs.safetensors")
    with meshdit.Transformer.from_pretrained(f"{DATA}/{case}", tp=2) as t:
        for name in ("a", "b"):
            path = f"{DATA}/lora/{case}/{name}.safetensors"
            if name == "b" and family != "flux":  # as test_lora.test_diffusers_form hands it over
                sd = load_file(path)
                alphas = {k: float(v) for k, v in sd.items() if k.endswith(".alpha")}
                t.load_lora_adapter({k: v for k, v in sd.items() if not k.endswith(".alpha")},
                                    adapter_name=name, network_alphas=alphas)
            else:
                sd, alphas, meta = family_lora_state_dict(family, path)
                t.load_lora_adapter(sd, adapter_name=name, network_alphas=alphas or None,
                                    metadata=meta or None)
        t.set_adapters(["a", "b"], [0.7, -1.3])
        if family == "qwenimage":
            from goldens_qwenimage import to_diffusers
            x = to_diffusers(x)
        with torch.no_grad():
            got = t(**x, return_dict=False)[0].numpy()
    print(f"{family} drop-in: {rel(got, want):.2e}")
    assert rel(got, want) <= TOL


def test_bad_adapters_are_refused_and_nothing_changes(adapters, inputs):
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny") as t:
        base = out(t, inputs)
        sd, alphas, meta = adapters["k"]
        bad = dict(sd)
        bad["transformer.transformer_blocks.0.attn.nope.lora_A.weight"] = torch.zeros(4, 32)
        bad["transformer.transformer_blocks.0.attn.nope.lora_B.weight"] = torch.zeros(32, 4)
        with pytest.raises(ServerError, match=r"map to no weight.*transformer_blocks\.0\.attn\.nope") as e:
            t.load_lora_adapter(bad, adapter_name="bad")
        shape = dict(sd)
        k = next(k for k in shape if k.endswith("lora_B.weight"))
        shape[k] = torch.zeros(shape[k].shape[0] + 1, shape[k].shape[1])
        with pytest.raises(ServerError, match=k.removeprefix("transformer.").replace(".", r"\.")) as e:
            t.load_lora_adapter(shape, adapter_name="shape")
        assert "adapter 'shape'" in str(e.value), str(e.value)  # the user's name, not the server's
        dora = {**dict(sd), "transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector":
                torch.ones(32)}
        with pytest.raises(ServerError, match="DoRA"):
            t.load_lora_adapter(dora, adapter_name="dora")
        with pytest.raises(NotImplementedError, match="hotswap"):
            t.load_lora_adapter(dict(sd), adapter_name="hot", hotswap=True)
        assert not getattr(t, "peft_config", None) and list(t.modules()) == [t]
        assert np.array_equal(out(t, inputs), base)
        load(t, adapters, "k", "k")
        with pytest.raises(ValueError, match="already in use"):
            load(t, adapters, "k", "k")
        with pytest.raises(ValueError, match="could not be found"):
            t.set_adapter("nope")
        assert t.active_adapters() == ["k"]


def test_non_finite_and_huge_weights_are_refused_at_the_call(adapters, inputs):
    """set_adapters' weights, fuse_lora's lora_scale and the forward's scale: a non-finite one
    or one past the server's bound (1e6) is a ValueError naming the argument and the user's
    adapter, at the call; the drop-in works on afterwards (a NaN scale left no NaN in peft)."""
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny") as t:
        load(t, adapters, "k", "mine")
        full = out(t, inputs)
        for w in (1e30, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"set_adapters\(\): the weight of adapter 'mine'"):
                t.set_adapters(["mine"], [w])
        with pytest.raises(ValueError, match=r"lora_scale.*\['mine'\].*finite"):
            t.fuse_lora(lora_scale=float("nan"))
        with pytest.raises(ValueError, match=r"joint_attention_kwargs\['scale'\].*'mine'"):
            out(t, inputs, float("nan"))
        t.set_adapters(["mine"], [1e5])
        with pytest.raises(ValueError, match=r"coefficient of adapter 'mine'"):
            out(t, inputs, 1e5)  # 1e10: past the bound only together
        t.set_adapters(["mine"], [1.0])
        assert np.array_equal(out(t, inputs), full)


def test_a_second_client_runs_without_the_first_ones_adapters(adapters, inputs):
    """Each forward names its adapters: a client that loaded none gets the base weights from a
    server whose other client has one fused (negative control for the per-forward set)."""
    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny", tp=2) as t:
        base = out(t, inputs)
        other = meshdit.Transformer.connect(t._client.endpoint)
        try:
            load(other, adapters, "k", "k")
            adapted = out(other, inputs)
            assert rel(adapted, base) > 100 * TOL
            assert np.array_equal(out(t, inputs), base)
            assert np.array_equal(out(other, inputs), adapted)
        finally:
            other.close()  # unloads its adapters from the shared server
        info = t._client.info()
        assert info["adapters"] == "[]" and info["adapters_loaded"] == "0", info


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    import flux_pipeline

    root = str(tmp_path_factory.mktemp("flux_lora_dropin"))
    flux_pipeline.build(root, seed=0)
    return root


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, ulysses=2)], ids=["tp2", "tp2xulysses2"])
def test_a_flux_pipeline_with_its_lora_calls(flux_root, layout):
    """FluxPipeline: pipe.load_lora_weights(kohya dict) twice, set_adapters, the generation's
    joint_attention_kwargs scale, fuse_lora / unfuse_lora, get_active_adapters and
    unload_lora_weights: the images equal diffusers' own pipeline's (1e-4) at every stage."""
    import flux_pipeline

    h = flux_pipeline.HEADS * flux_pipeline.HEAD_DIM
    l1, l2 = (kohya_flux(seed=s, h=h, double=2, single=2) for s in (1, 2))
    ref = flux_pipeline.load(flux_root)
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", **layout) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        gen = dict(seed=3, steps=2, size=64)
        base = flux_pipeline.generate(pipe, **gen)

        def same(what, **kw):
            want, got = flux_pipeline.generate(ref, **gen, **kw), flux_pipeline.generate(pipe, **gen, **kw)
            assert rel(got, want) <= TOL, what
            assert pipe.get_active_adapters() == ref.get_active_adapters(), what
            assert pipe.get_list_adapters() == ref.get_list_adapters(), what
            return got

        for p in (ref, pipe):
            p.load_lora_weights(dict(l1), adapter_name="one")
            p.load_lora_weights(dict(l2), adapter_name="two")
            p.set_adapters(["one", "two"], [0.8, 0.5])
        assert rel(same("two adapters"), base) > 100 * TOL
        same("scale", joint_attention_kwargs={"scale": 0.5})
        for p in (ref, pipe):
            p.fuse_lora(adapter_names=["one"], lora_scale=0.9)
        assert pipe.num_fused_loras == ref.num_fused_loras == 1
        same("fused")
        for p in (ref, pipe):
            p.unfuse_lora()
            p.unload_lora_weights()
        assert np.array_equal(flux_pipeline.generate(pipe, **gen), base)
        same("unloaded")


def test_threads_and_hostile_values(adapters, inputs):
    """A forward with a LoRA scale in one thread does not leak it into another's forward; a
    per-block weight dict is refused; peft's x * s / s residue does not keep an adapter alive."""
    import threading

    with meshdit.Transformer.from_pretrained(f"{DATA}/flux_tiny") as t:
        base = out(t, inputs)
        load(t, adapters, "k", "k")
        full, half = out(t, inputs), out(t, inputs, 0.5)
        got, errs = [], []

        def worker(scale):
            try:
                for _ in range(6):
                    got.append((scale, out(t, inputs, scale)))
            except Exception as e:  # noqa: BLE001
                errs.append(e)
        th = [threading.Thread(target=worker, args=(s,)) for s in (None, 0.5)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        assert not errs and len(got) == 12
        for scale, o in got:
            assert np.array_equal(o, full if scale is None else half)
        with pytest.raises(NotImplementedError, match="per-block"):
            t.set_adapters(["k"], [{"transformer_blocks": 0.5}])
        t.set_adapters(["k"], [0.8])
        t.fuse_lora()
        out(t, inputs, 0.7)
        t.unfuse_lora()
        t.delete_adapters("k")
        assert np.array_equal(out(t, inputs), base)
        assert t._client.info()["adapters_loaded"] == "0"  # no residue kept "k" on the server
        assert _lora_layers(t)  # its layer stays, holding nothing, as in diffusers
        t.unload_lora()
        assert np.array_equal(out(t, inputs), base)
        assert list(t.modules()) == [t]
