"""LoRA adapters as diffusers' loaders hand them over, run on the mesh: diffusers' own conversion
(the family's ``lora_state_dict``: kohya names for Flux, diffusers/peft form for Flux, Flux.2,
Qwen-Image and Wan) turned into one safetensors blob by `meshdit._lora.adapter_blob`, fused by
``meshdit run --lora`` on one rank, tp=2 and tp=2 x ulysses=2, and compared with diffusers + peft
on the same state dict (``load_lora_adapter`` + ``set_adapters``), within 1e-4. Also: a blob
with no transformer keys is refused here, a key meshdit cannot map is refused by the run with the
key named, and a scale of 0 is the base run bit for bit.

The adapters are made here or are scripts/goldens_lora.py's (tests/data/lora); nothing is
downloaded. The drop-in's own LoRA API (pipe.load_lora_weights on meshdit.Transformer, ...) is
tests/python/test_lora_dropin.py's."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from meshdit._lora import adapter_blob, family_lora_state_dict

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
BIN = os.environ.get("MESHDIT_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "meshdit"))
MPIEXEC = shutil.which("mpiexec.mpich") or shutil.which("mpiexec")
LAYOUTS = [(1, []), (2, ["--tp", "2"]), (4, ["--tp", "2", "--ulysses", "2"])]
TOL = 1e-4


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run(case, loras, n=1, layout=(), check=True):
    """meshdit run on tests/data/CASE with --lora FILE:SCALE for each (file, scale)."""
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mdt_lora_py_{os.getpid()}_{n}.safetensors")
    args = [BIN, "run", "--checkpoint", f"{DATA}/{case}", "--inputs",
            f"{DATA}/{case}/inputs.safetensors", "--out", out, "--quiet", *layout]
    for f, s in loras:
        args += ["--lora", f"{f}:{s}"]
    if n > 1:
        args = [MPIEXEC, "-n", str(n), *args]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    if check:
        assert p.returncode == 0, p.stderr
    if p.returncode:
        return p
    res = load_file(out)["sample"].numpy()
    os.unlink(out)
    return res


def reference(case, cls, call, adapters):
    """diffusers + peft: each (state_dict, alphas, metadata, weight) loaded as the pipeline loads
    it (load_lora_adapter with prefix "transformer"), then set_adapters with the weights."""
    m = cls.from_pretrained(f"{DATA}/{case}", torch_dtype=torch.float32).eval()
    names = []
    for i, (sd, alphas, meta, _) in enumerate(adapters):
        m.load_lora_adapter(dict(sd), prefix="transformer", adapter_name=f"x{i}",
                            network_alphas=alphas or None,
                            metadata={k.removeprefix("transformer."): v for k, v in meta.items()}
                            if meta else None)
        names.append(f"x{i}")
    m.set_adapters(names, [w for *_, w in adapters])
    inputs = load_file(f"{DATA}/{case}/inputs.safetensors")
    with torch.no_grad():
        return call(m, inputs).numpy()


def kohya_flux(seed=0, r=4, h=32, double=1, single=1):
    """A kohya (sd-scripts) Flux LoRA for a Flux of width h (flux_tiny: 32): BFL module names,
    lora_down / lora_up, an alpha per module. single_blocks.N.linear1 is left out: diffusers'
    converter splits it by FLUX.1's own widths (3072), not the config's."""
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for b in range(double):
        for s in ("img", "txt"):
            mods.update({f"double_blocks_{b}_{s}_attn_qkv": (3 * h, h),
                         f"double_blocks_{b}_{s}_attn_proj": (h, h),
                         f"double_blocks_{b}_{s}_mlp_0": (4 * h, h),
                         f"double_blocks_{b}_{s}_mlp_2": (h, 4 * h),
                         f"double_blocks_{b}_{s}_mod_lin": (6 * h, h)})
    for b in range(single):
        mods.update({f"single_blocks_{b}_linear2": (h, 5 * h),
                     f"single_blocks_{b}_modulation_lin": (3 * h, h)})
    sd = {}
    for k, (o, i) in mods.items():
        sd[f"lora_unet_{k}.lora_down.weight"] = 0.3 * torch.randn(r, i, generator=g)
        sd[f"lora_unet_{k}.lora_up.weight"] = 0.3 * torch.randn(o, r, generator=g)
        sd[f"lora_unet_{k}.alpha"] = torch.tensor(2.0 if "mlp" in k else 8.0)
    return sd


def write(tmp_path, name, blob):
    p = tmp_path / f"{name}.safetensors"
    p.write_bytes(blob)
    return str(p)


def _families():
    import sys

    from diffusers import (Flux2Transformer2DModel, FluxTransformer2DModel,
                           QwenImageTransformer2DModel, WanTransformer3DModel)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    from goldens_qwenimage import to_diffusers

    def plain(m, x):
        return m(**x, return_dict=False)[0]
    return {"flux": ("flux_tiny", FluxTransformer2DModel, plain),
            "flux2": ("flux2_tiny", Flux2Transformer2DModel, plain),
            "qwenimage": ("qwenimage_tiny", QwenImageTransformer2DModel,
                          lambda m, x: m(**to_diffusers(x), return_dict=False)[0]),
            "wan": ("wan_tiny", WanTransformer3DModel, plain)}


@pytest.mark.parametrize("n,layout", LAYOUTS, ids=["1rank", "tp2", "tp2xulysses2"])
def test_kohya_flux(tmp_path, n, layout):
    """kohya names through diffusers' converter (alphas baked into the factors by it), fused on
    the mesh at 0.8, equal to diffusers + peft on the converted state dict."""
    sd, alphas, meta = family_lora_state_dict("flux", kohya_flux())
    assert any(".lora_A." in k for k in sd) and not alphas
    f = write(tmp_path, "kohya", adapter_blob(sd, alphas, meta))
    fam = _families()["flux"]
    ref = reference(fam[0], fam[1], fam[2], [(sd, alphas, meta, 0.8)])
    got = run(fam[0], [(f, 0.8)], n, layout)
    base = run(fam[0], [], n, layout)
    print(f"kohya flux n={n}: {rel(got, ref):.2e}")
    assert rel(got, ref) <= TOL
    assert rel(base, ref) > 100 * TOL  # the adapter did something


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage", "wan"])
@pytest.mark.parametrize("n,layout", LAYOUTS, ids=["1rank", "tp2", "tp2xulysses2"])
def test_diffusers_form(tmp_path, family, n, layout):
    """The goldens' adapters (metadata with alpha/rank patterns; .alpha keys and lora_B.bias)
    read by the family's lora_state_dict, two at once with weights."""
    case, cls, call = _families()[family]
    adapters = []
    for name, w in (("a", 0.7), ("b", -1.3)):
        path = f"{DATA}/lora/{case}/{name}.safetensors"
        if name == "b" and family != "flux":
            # only Flux's lora_state_dict pops `.alpha` keys into network alphas; the others take
            # them for another format (test_alpha_keys_elsewhere): hand them over as Flux does
            sd = load_file(path)
            alphas = {k: float(v) for k, v in sd.items() if k.endswith(".alpha")}
            sd, meta = {k: v for k, v in sd.items() if not k.endswith(".alpha")}, None
        else:
            sd, alphas, meta = family_lora_state_dict(family, path)
        adapters.append((sd, alphas, meta, w))
    files = [(write(tmp_path, f"{family}{i}", adapter_blob(sd, al, me)), w)
             for i, (sd, al, me, w) in enumerate(adapters)]
    got = run(case, files, n, layout)
    want = load_file(f"{DATA}/lora/{case}/expected_ab.safetensors")["sample"].numpy()
    print(f"{family} n={n}: {rel(got, want):.2e}")
    assert rel(got, want) <= TOL


def test_alpha_keys_elsewhere(tmp_path):
    """Qwen-Image's lora_state_dict takes a diffusers file with `.alpha` keys for a non-diffusers
    one and prefixes its keys again ("transformer.transformer..."): diffusers then loads none of
    them; meshdit refuses the adapter, naming the keys, instead of running without it."""
    sd, alphas, meta = family_lora_state_dict("qwenimage", f"{DATA}/lora/qwenimage_tiny/b.safetensors")
    assert any(k.startswith("transformer.transformer.") for k in sd)
    f = write(tmp_path, "qb", adapter_blob(sd, alphas, meta))
    p = run("qwenimage_tiny", [(f, 1.0)], check=False)
    assert p.returncode == 1 and "map to no weight" in p.stderr
    assert "'transformer.transformer.transformer_blocks.0.attn.to_q.lora_A.weight'" in p.stderr


def test_scale_zero_is_base(tmp_path):
    sd, alphas, meta = family_lora_state_dict("flux", kohya_flux())
    f = write(tmp_path, "k0", adapter_blob(sd, alphas, meta))
    assert np.array_equal(run("flux_tiny", [(f, 0)]), run("flux_tiny", []))


def test_blob_errors(tmp_path):
    """No transformer keys: refused here. A key that maps to nothing: the run fails naming it."""
    with pytest.raises(ValueError, match="no 'transformer.' keys"):
        adapter_blob({"text_encoder.x.lora_A.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="cannot both"):
        adapter_blob({"transformer.x.lora_A.weight": torch.zeros(2, 2)}, {"transformer.x.alpha": 1},
                     {"r": 2})
    sd, alphas, meta = family_lora_state_dict("flux", kohya_flux())
    sd["transformer.transformer_blocks.0.attn.nope.lora_A.weight"] = torch.zeros(4, 32)
    f = write(tmp_path, "bad", adapter_blob(sd, alphas, meta))
    p = run("flux_tiny", [(f, 1.0)], check=False)
    assert p.returncode == 1
    assert "1 key maps to no weight" in p.stderr
    assert "transformer.transformer_blocks.0.attn.nope.lora_A.weight" in p.stderr
    blob = adapter_blob({"transformer.x.lora_A.weight": torch.zeros(2, 2, dtype=torch.bfloat16)},
                        metadata={"r": 2, "target_modules": {"x"}})
    n = int.from_bytes(blob[:8], "little")
    head = json.loads(blob[8:8 + n])
    assert head["transformer.x.lora_A.weight"]["dtype"] == "BF16"
    assert json.loads(head["__metadata__"]["lora_adapter_metadata"]) == {
        "transformer.r": 2, "transformer.target_modules": ["x"]}


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    import flux_pipeline

    root = str(tmp_path_factory.mktemp("flux_lora_pipe"))
    flux_pipeline.build(root, seed=0)
    return root


@pytest.mark.parametrize("layout", [dict(), dict(tp=2), dict(tp=2, ulysses=2)],
                         ids=["1rank", "tp2", "tp2xulysses2"])
def test_flux_pipeline_kohya(flux_root, tmp_path, layout):
    """A real FluxPipeline: diffusers' pipe.load_lora_weights(kohya dict) + set_adapters against
    the same dict converted here and fused at the start of meshdit serve (--lora through
    from_pretrained's extra=), the decoded images within 1e-4."""
    import flux_pipeline
    import meshdit

    h = flux_pipeline.HEADS * flux_pipeline.HEAD_DIM
    lora = kohya_flux(seed=1, h=h, double=2, single=2)
    pipe = flux_pipeline.load(flux_root)
    pipe.load_lora_weights(dict(lora), adapter_name="k")
    pipe.set_adapters(["k"], [0.8])
    want = flux_pipeline.generate(pipe, seed=3, steps=2, size=64)
    base = flux_pipeline.generate(flux_pipeline.load(flux_root), seed=3, steps=2, size=64)
    f = write(tmp_path, "kohya", adapter_blob(*family_lora_state_dict("flux", lora)))
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", extra=["--lora", f"{f}:0.8"],
                                             **layout) as t:
        got = flux_pipeline.generate(flux_pipeline.load(flux_root, transformer=t), seed=3, steps=2,
                                     size=64)
    print(f"flux pipeline kohya {layout}: {rel(got, want):.2e}")
    assert rel(got, want) <= TOL
    assert rel(base, want) > 100 * TOL
