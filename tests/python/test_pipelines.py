"""Real diffusers pipelines end to end: the same pipeline, weights and seed, once with diffusers'
own transformer and once with `meshdit.Transformer` on several layouts; the decoded outputs
agree within 1e-4 relative (f32). The pipelines are built locally from small random components
(tests/python/*_pipeline.py): nothing is downloaded."""
import importlib

import numpy as np
import pytest
import torch

import flux_pipeline
import meshdit

LAYOUTS = [dict(), dict(tp=2, ulysses=2), dict(ring=2)]
TOL = 1e-4


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("flux_pipe"))
    flux_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def flux_ref(flux_root):
    torch.manual_seed(0)
    pipe = flux_pipeline.load(flux_root)
    return {"plain": flux_pipeline.generate(pipe, seed=3, steps=3, size=64),
            "cfg": flux_pipeline.generate(pipe, seed=3, steps=2, size=64, true_cfg_scale=2.0,
                                          negative_prompt="a blue ball"),
            "seed4": flux_pipeline.generate(pipe, seed=4, steps=3, size=64)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_flux_pipeline(flux_root, flux_ref, layout):
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", **layout) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        assert pipe.transformer is t
        img = flux_pipeline.generate(pipe, seed=3, steps=3, size=64)
        assert t.stats["forwards"] == 3  # every step ran on the mesh
        assert int(t.info["world"]) == int(np.prod(list(layout.values()) or [1]))
    assert img.shape == flux_ref["plain"].shape == (64, 64, 3)
    print(f"flux {layout}: max rel diff {rel(img, flux_ref['plain']):.2e}")
    assert rel(img, flux_ref["plain"]) <= TOL
    assert rel(flux_ref["seed4"], flux_ref["plain"]) > 100 * TOL  # the comparison can fail


def test_flux_pipeline_true_cfg_sessions(flux_root, flux_ref):
    """Classifier-free guidance alternates two prompts: each prompt's constant tensors move once
    (two sessions), and the image still equals diffusers'."""
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer", tp=2) as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        img = flux_pipeline.generate(pipe, seed=3, steps=2, size=64, true_cfg_scale=2.0,
                                     negative_prompt="a blue ball")
        sent = t.stats["request_bytes"]
    assert len(sent) == 4 and max(sent[2:]) < min(sent[:2]) / 3, sent
    assert rel(img, flux_ref["cfg"]) <= TOL


# ---- MiniMax-H3 (modular pipeline, text to video + audio), Qwen-Image (a batch of two prompts
# with true CFG and padded masks), Wan 2.1 (text to video with CFG): the same check for each ----
# family: (builder module, drop-in class, seeds of the reference and of the control, transformer
# calls of one 2-step generate, a check of the output's shape)
FAMILIES = {
    "h3": ("h3_pipeline", meshdit.MiniMaxH3Transformer, (5, 6), 2, lambda out: set(out) == {"video", "audio"}),
    "qwenimage": ("qwenimage_pipeline", meshdit.QwenImageTransformer, (7, 8), 4,
                  lambda out: out["out"].shape[0] == 2),  # 2 steps x (prompt, negative prompt)
    "wan": ("wan_pipeline", meshdit.WanTransformer, (9, 10), 4, lambda out: out["out"].ndim == 4),
}
_built = {}


def _outputs(x):
    return x if isinstance(x, dict) else {"out": x}


def _family(name, tmp_path_factory):
    """The family's pipeline built once per module, and diffusers' outputs for both seeds."""
    if name not in _built:
        mod = importlib.import_module(FAMILIES[name][0])
        root = str(tmp_path_factory.mktemp(f"{name}_pipe"))
        mod.build(root, seed=0)
        pipe = mod.load(root)
        ref, other = (_outputs(mod.generate(pipe, seed=s, steps=2)) for s in FAMILIES[name][2])
        _built[name] = (mod, root, ref, other)
    return _built[name]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
@pytest.mark.parametrize("name", FAMILIES)
def test_family_pipeline(name, layout, tmp_path_factory):
    mod, root, ref, other = _family(name, tmp_path_factory)
    _, cls, (seed, _), forwards, shape_ok = FAMILIES[name]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        assert isinstance(t, cls)
        got = _outputs(mod.generate(mod.load(root, transformer=t), seed=seed, steps=2))
        assert t.stats["forwards"] == forwards  # every transformer call ran on the mesh
    assert shape_ok(got) and set(got) == set(ref)
    for k in ref:
        assert got[k].shape == ref[k].shape
        print(f"{name} {layout} {k}: max rel diff {rel(got[k], ref[k]):.2e}")
        assert rel(got[k], ref[k]) <= TOL
        assert rel(other[k], ref[k]) > 100 * TOL  # the comparison can fail


# ---- Wan 2.1 image-to-video with the text padded to 226 tokens, not 512: diffusers' attention cuts
# [image | text] at its length - 512, so part of the text goes to the image attention; meshdit makes
# the same cut (it used to attend the image over the image tokens only: rel ~0.2 per call) ----
@pytest.fixture(scope="module")
def wan_i2v(tmp_path_factory):
    import wan_pipeline

    root = str(tmp_path_factory.mktemp("wan_i2v_pipe"))
    wan_pipeline.build_i2v(root, seed=0)
    pipe = wan_pipeline.load_i2v(root)
    return root, wan_pipeline.generate_i2v(pipe, seed=11), wan_pipeline.generate_i2v(pipe, seed=12)


@pytest.mark.parametrize("layout", [dict(), dict(tp=2, ulysses=2)], ids=["1rank", "tp2xulysses2"])
def test_wan_i2v_pipeline_text_length(wan_i2v, layout):
    import wan_pipeline

    root, ref, other = wan_i2v
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        assert isinstance(t, meshdit.WanTransformer)
        got = wan_pipeline.generate_i2v(wan_pipeline.load_i2v(root, transformer=t), seed=11)
        assert t.stats["forwards"] == 4  # 2 steps x (prompt, negative prompt), each on the mesh
    assert got.shape == ref.shape == (wan_pipeline.NUM_FRAMES, wan_pipeline.HEIGHT, wan_pipeline.WIDTH, 3)
    print(f"wan i2v {layout}: max rel diff {rel(got, ref):.2e}")
    assert rel(got, ref) <= TOL
    assert rel(other, ref) > 100 * TOL  # the comparison can fail


# ---- Flux.2 [klein]: Flux2KleinPipeline, two prompts with CFG, text and image-conditioned --------
@pytest.fixture(scope="module")
def flux2_root(tmp_path_factory):
    import flux2_pipeline
    root = str(tmp_path_factory.mktemp("flux2_pipe"))
    flux2_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def flux2_ref(flux2_root):
    import flux2_pipeline
    pipe = flux2_pipeline.load(flux2_root)
    image = flux2_pipeline.reference_image()
    return {"text": flux2_pipeline.generate(pipe, seed=11),
            "edit": flux2_pipeline.generate(pipe, seed=11, image=image),
            "other": flux2_pipeline.generate(pipe, seed=12, image=image)}


def test_pipeline_reaching_into_the_blocks_is_told_why(flux2_root):
    """Flux2KleinKVPipeline sets KV-cache attention processors on every block of its transformer
    when it is built; the blocks run on the mesh, so that is an AttributeError saying so (it was
    torch's bare "'Flux2Transformer' object has no attribute 'transformer_blocks'"), and hasattr()
    still reads the blocks as absent."""
    import diffusers
    from pipeline_util import load_pipeline
    with meshdit.Transformer.from_pretrained(f"{flux2_root}/transformer") as t:
        with pytest.raises(AttributeError, match="meshdit: Flux2Transformer has no "
                                                 "'transformer_blocks': .* KV cache"):
            load_pipeline(diffusers.Flux2KleinKVPipeline, flux2_root, t)
        assert not hasattr(t, "transformer_blocks") and not hasattr(t, "single_transformer_blocks")
        with pytest.raises(AttributeError, match="'no_such_thing'") as e:
            t.no_such_thing  # noqa: B018 (any other name: torch's own message)
        assert "meshdit" not in str(e.value)

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_flux2_pipeline(flux2_root, flux2_ref, layout):
    import flux2_pipeline
    with meshdit.Transformer.from_pretrained(f"{flux2_root}/transformer", **layout) as t:
        assert isinstance(t, meshdit.Flux2Transformer)
        pipe = flux2_pipeline.load(flux2_root, transformer=t)
        text = flux2_pipeline.generate(pipe, seed=11)
        edit = flux2_pipeline.generate(pipe, seed=11, image=flux2_pipeline.reference_image())
        assert t.stats["forwards"] == 8  # 2 runs x 2 steps x (prompt, negative prompt)
    for name, got in (("text", text), ("edit", edit)):
        ref = flux2_ref[name]
        assert got.shape == ref.shape == (2, flux2_pipeline.HEIGHT, flux2_pipeline.WIDTH, 3)
        print(f"flux2 {layout} {name}: max rel diff {rel(got, ref):.2e}")
        assert rel(got, ref) <= TOL
    assert rel(flux2_ref["other"], flux2_ref["edit"]) > 100 * TOL  # the comparison can fail
    assert rel(flux2_ref["text"], flux2_ref["edit"]) > 100 * TOL  # the reference image matters


def test_flux2_dev_pipeline_guidance(flux2_root):
    """FLUX.2 [dev]'s Flux2Pipeline (guidance-distilled: a guidance tensor on every forward) from
    prompt_embeds, with a transformer that has the guidance embedder; tp2 x ulysses2 against diffusers,
    and a different guidance scale differs (the guidance input reaches the mesh)."""
    import flux2_pipeline
    flux2_pipeline.build_dev(flux2_root, seed=0)
    embeds = flux2_pipeline.dev_prompt_embeds(flux2_pipeline.load(flux2_root))
    ref_pipe = flux2_pipeline.load_dev(flux2_root)
    ref = flux2_pipeline.generate_dev(ref_pipe, embeds, seed=13)
    other = flux2_pipeline.generate_dev(ref_pipe, embeds, seed=13, guidance_scale=1.5)
    with meshdit.Transformer.from_pretrained(f"{flux2_root}/transformer_dev", tp=2, ulysses=2) as t:
        got = flux2_pipeline.generate_dev(flux2_pipeline.load_dev(flux2_root, transformer=t), embeds, seed=13)
        assert t.stats["forwards"] == 2
    print(f"flux2 dev tp2 x ulysses2: max rel diff {rel(got, ref):.2e}")
    assert got.shape == ref.shape and rel(got, ref) <= TOL
    assert rel(other, ref) > 100 * TOL


# ---- the common pipeline arguments, every family: several images per prompt, CFG on and off,
# output_type="latent", a callback_on_step_end that edits the latents ---------------------------
def _edit_latents(pipe, i, t, kwargs):
    """A callback_on_step_end that changes what the next step's transformer call gets."""
    return {"latents": kwargs["latents"] * 0.8 + 0.05}


COMMON_ARGS = dict(output_type="latent", callback_on_step_end=_edit_latents,
                   callback_on_step_end_tensor_inputs=["latents"])
# family: (builder module, a multi-rank layout, the call with CFG on (on top of COMMON_ARGS, with
# 2 images per prompt and the attention kwargs that change nothing), what turns CFG off, the
# images of one call)
COMMON = {
    "flux": ("flux_pipeline", dict(ring=2),
             dict(num_images_per_prompt=2, true_cfg_scale=2.0, negative_prompt="a blue ball",
                  joint_attention_kwargs={"scale": 1.0}), dict(true_cfg_scale=1.0), 2),
    "flux2": ("flux2_pipeline", dict(tp=2),
              dict(num_images_per_prompt=2, guidance_scale=10.0, attention_kwargs={"scale": 1.0}),
              dict(guidance_scale=1.0), 4),
    "qwenimage": ("qwenimage_pipeline", dict(ulysses=2),
                  dict(num_images_per_prompt=2, attention_kwargs={"scale": 1.0}),
                  dict(true_cfg_scale=1.0), 4),
    "wan": ("wan_pipeline", dict(ring=2),
            dict(num_videos_per_prompt=2, attention_kwargs={"scale": 1.0}),
            dict(guidance_scale=1.0), 2),
}
_common = {}


def _common_family(name, request, tmp_path_factory):
    """The family's built pipeline and diffusers' outputs of the CFG call, the no-CFG call and the
    CFG call without the callback (the controls)."""
    if name not in _common:
        mod = importlib.import_module(COMMON[name][0])
        root = (request.getfixturevalue(f"{name}_root") if name in ("flux", "flux2")
                else _family(name, tmp_path_factory)[1])
        _, _, cfg, nocfg, _ = COMMON[name]
        pipe = mod.load(root)
        refs = {"cfg": mod.generate(pipe, seed=21, steps=2, **COMMON_ARGS, **cfg),
                "nocfg": mod.generate(pipe, seed=21, steps=2, **COMMON_ARGS, **{**cfg, **nocfg}),
                "nocallback": mod.generate(pipe, seed=21, steps=2, output_type="latent", **cfg)}
        _common[name] = (mod, root, refs)
    return _common[name]


@pytest.mark.parametrize("multi", [False, True], ids=["1rank", "2ranks"])
@pytest.mark.parametrize("name", COMMON)
def test_common_pipeline_arguments(name, multi, request, tmp_path_factory):
    """Each family's pipeline with 2 images (videos) per prompt, CFG on and off, latent output and
    a callback that edits the latents between steps: meshdit equals diffusers' transformer."""
    mod, root, refs = _common_family(name, request, tmp_path_factory)
    _, layout, cfg, nocfg, images = COMMON[name]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **(layout if multi else {})) as t:
        pipe = mod.load(root, transformer=t)
        got = {"cfg": mod.generate(pipe, seed=21, steps=2, **COMMON_ARGS, **cfg),
               "nocfg": mod.generate(pipe, seed=21, steps=2, **COMMON_ARGS, **{**cfg, **nocfg})}
        assert t.stats["forwards"] == 2 * 2 + 2 * 1  # 2 steps with CFG (2 calls), 2 without
    for k, x in got.items():
        assert x.shape == refs[k].shape and x.shape[0] == images
        print(f"{name} {layout if multi else '1 rank'} {k}: max rel diff {rel(x, refs[k]):.2e}")
        assert rel(x, refs[k]) <= TOL
    # each argument changes diffusers' result, so each comparison above can fail
    assert rel(refs["nocfg"], refs["cfg"]) > 100 * TOL
    assert rel(refs["nocallback"], refs["cfg"]) > 100 * TOL
    assert rel(refs["cfg"][1], refs["cfg"][0]) > 100 * TOL  # one prompt's two images


@pytest.mark.parametrize("layout", [dict(), dict(tp=2)], ids=["1rank", "tp2"])
def test_h3_latent_output(layout, tmp_path_factory):
    """MiniMax-H3's modular t2va pipeline takes one prompt, one video and no CFG (guidance-
    distilled) and has no step callback; its latent outputs (with attention_kwargs that change
    nothing) against diffusers'."""
    mod, root, _, _ = _family("h3", tmp_path_factory)
    key = "h3_latent"
    if key not in _common:
        pipe = mod.load(root)
        _common[key] = [mod.generate(pipe, seed=s, steps=2, latent=True) for s in (5, 6)]
    ref, other = _common[key]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        got = mod.generate(mod.load(root, transformer=t), seed=5, steps=2, latent=True,
                           attention_kwargs={"scale": 1.0})
        assert t.stats["forwards"] == 2
    for k in ref:
        assert got[k].shape == ref[k].shape
        print(f"h3 {layout} latent {k}: max rel diff {rel(got[k], ref[k]):.2e}")
        assert rel(got[k], ref[k]) <= TOL
        assert rel(other[k], ref[k]) > 100 * TOL


# ---- Qwen-Image-Edit-2511: QwenImageEditPlusPipeline editing two reference images with a
# zero_cond_t transformer (the condition images' rows, after img_shapes' first entry, modulated at
# timestep 0); the vision tower of the text encoder reads the images, the VAE encodes them ----
EDIT_LAYOUTS = [dict(), dict(ring=2), dict(ulysses=2), dict(tp=2), dict(tp=2, ulysses=2)]


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory):
    """The pipeline built once; diffusers' image for seed 5 (and the transformer inputs of its 4
    calls), for seed 6, and for seed 5 with the same weights and zero_cond_t set False."""
    import qwenimage_edit_pipeline as qe

    root = str(tmp_path_factory.mktemp("qwenimage_edit_pipe"))
    qe.build(root, seed=0)
    pipe = qe.load(root)
    calls, hook = qe.img_shapes_hook(pipe.transformer)
    ref = qe.generate(pipe, seed=5)
    hook.remove()
    other = qe.generate(pipe, seed=6)
    no_zero_cond = qe.generate(qe.load(root, transformer=qe.load_transformer(root, zero_cond_t=False)), seed=5)
    return root, ref, calls, other, no_zero_cond


def test_qwenimage_edit_pipeline_controls(qwen_edit):
    """diffusers' transformer gets the condition images' rows after the output's (img_shapes with
    3 entries), and each comparison below can fail: another seed differs, and so does the same
    pipeline with zero_cond_t set False."""
    import qwenimage_edit_pipeline as qe

    root, ref, calls, other, no_zero_cond = qwen_edit
    with open(f"{root}/transformer/config.json") as f:
        assert '"zero_cond_t": true' in f.read()
    want = [[(1, 4, 4), (1, 4, 6), (1, 6, 4)]]  # the 64 x 64 output, then the 96 x 64 and 64 x 96 images
    assert qe.expected_img_shapes() == want
    assert len(calls) == 4  # 2 steps x (prompt, negative prompt)
    for c in calls:
        assert c["img_shapes"] == want
        assert c["hidden_states"] == (1, 16 + 24 + 24, 16)
    assert ref.shape == (1, qe.HEIGHT, qe.WIDTH, 3)
    print(f"qwenimage edit: rel diff other seed {rel(other, ref):.2e}, zero_cond_t False {rel(no_zero_cond, ref):.2e}")
    assert rel(other, ref) > 100 * TOL  # the comparison can fail
    assert rel(no_zero_cond, ref) > 100 * TOL  # zero_cond_t matters


@pytest.mark.parametrize("layout", EDIT_LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_qwenimage_edit_pipeline(qwen_edit, layout):
    import warnings

    import qwenimage_edit_pipeline as qe

    root, ref, ref_calls, _, _ = qwen_edit
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        assert isinstance(t, meshdit.QwenImageTransformer)
        assert t.config.zero_cond_t is True
        calls, hook = qe.img_shapes_hook(t)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = qe.generate(qe.load(root, transformer=t), seed=5)
        hook.remove()
        assert t.stats["forwards"] == 4  # every transformer call ran on the mesh
    assert calls == ref_calls  # the drop-in got what diffusers' model got (3 img_shapes entries)
    assert not [str(w.message) for w in caught if "meshdit" in str(w.message)]
    assert got.shape == ref.shape
    print(f"qwenimage edit {layout}: max rel diff {rel(got, ref):.2e}")
    assert rel(got, ref) <= TOL


# ---- Qwen-Image-Layered: QwenImageLayeredPipeline decomposing an RGBA image into layers with a
# use_additional_t_cond + use_layer3d_rope transformer (the input image, img_shapes' last entry, at
# frame -1 and never stepped; the pipeline's is_rgb row added to the timestep embedding) ----
LAYERED_LAYOUTS = [dict(), dict(ulysses=2), dict(tp=2, ring=2)]


@pytest.fixture(scope="module")
def qwen_layered(tmp_path_factory):
    """The pipeline built once; diffusers' layers for seed 5 (and its transformer calls' inputs), for
    seed 6, for another input image, and for the same weights with use_layer3d_rope False."""
    import qwenimage_layered_pipeline as ql

    root = str(tmp_path_factory.mktemp("qwenimage_layered_pipe"))
    ql.build(root, seed=0)
    pipe = ql.load(root)
    calls, hook = ql._qe.img_shapes_hook(pipe.transformer)
    ref = ql.generate(pipe, seed=5)
    hook.remove()
    controls = {"seed 6": ql.generate(pipe, seed=6),
                "another input image": ql.generate(pipe, seed=5, image=ql.input_image(seed=1)),
                "use_layer3d_rope False": ql.generate(
                    ql.load(root, transformer=ql.load_transformer(root, use_layer3d_rope=False)), seed=5)}
    return root, ref, calls, controls


def test_qwenimage_layered_pipeline_controls(qwen_layered):
    """diffusers' transformer gets the layers' rows then the input image's (img_shapes with 3
    entries at 640 px), and each comparison below can fail: another seed, another input image and
    the same weights without use_layer3d_rope each give other layers."""
    import qwenimage_layered_pipeline as ql

    root, ref, calls, controls = qwen_layered
    assert len(calls) == 4  # 2 steps x (prompt, negative prompt)
    for c in calls:
        assert c["img_shapes"] == [[(1, 40, 40)] * 3]  # 2 latent frames (LAYERS + 1), the input image
        assert c["hidden_states"] == (1, 3 * 1600, 4 * ql.Z_DIM)
    assert ref.shape == (ql.LAYERS, ql.RESOLUTION, ql.RESOLUTION, 4)
    for name, other in controls.items():
        print(f"qwenimage layered: rel diff {name} {rel(other, ref):.2e}")
        assert rel(other, ref) > 100 * TOL, name


@pytest.mark.parametrize("layout", LAYERED_LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_qwenimage_layered_pipeline(qwen_layered, layout):
    import qwenimage_layered_pipeline as ql

    root, ref, ref_calls, _ = qwen_layered
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        assert t.config.use_additional_t_cond is True and t.config.use_layer3d_rope is True
        calls, hook = ql._qe.img_shapes_hook(t)
        got = ql.generate(ql.load(root, transformer=t), seed=5)
        hook.remove()
        assert t.stats["forwards"] == 4  # every transformer call ran on the mesh
    assert calls == ref_calls
    print(f"qwenimage layered {layout}: max rel diff {rel(got, ref):.2e}")
    assert got.shape == ref.shape and rel(got, ref) <= TOL


# ---- ControlNet: FluxControlNetPipeline and QwenImageControlNetPipeline, the ControlNet in the
# pipeline's process and its residuals sent to the mesh each step; true CFG reads them in both
# branches (Qwen-Image: two prompts whose masks differ, a pass each on the mesh) ----
CONTROLNET_LAYOUTS = [dict(), dict(ulysses=2), dict(tp=2), dict(tp=2, ring=2)]


@pytest.fixture(scope="module", params=["flux", "qwenimage"])
def controlnet_pipe(request, tmp_path_factory):
    """(family, root, diffusers' image for seed 3, the controls: conditioning scale 0 (no
    residuals), another control image)."""
    import controlnet_pipeline as cp

    fam = request.param
    root = str(tmp_path_factory.mktemp(f"controlnet_{fam}"))
    cp.build(root, fam, seed=0)
    pipe = cp.load(root, fam)
    ref = cp.generate(pipe, fam, seed=3)
    controls = {"no residuals": cp.generate(pipe, fam, seed=3, scale=0.0),
                "another control image": cp.generate(pipe, fam, seed=3, image=cp.control_image(seed=1))}
    return fam, root, ref, controls


def test_controlnet_pipeline_controls(controlnet_pipe):
    """Each comparison below can fail: without the residuals, or with another control image, the
    pipeline gives another image."""
    fam, _, ref, controls = controlnet_pipe
    for name, other in controls.items():
        print(f"{fam} controlnet: rel diff {name} {rel(other, ref):.2e}")
        assert rel(other, ref) > 100 * TOL, name


@pytest.mark.parametrize("layout", CONTROLNET_LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_controlnet_pipeline(controlnet_pipe, layout):
    import controlnet_pipeline as cp

    fam, root, ref, _ = controlnet_pipe
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        got = cp.generate(cp.load(root, fam, transformer=t), fam, seed=3)
        assert t.stats["forwards"] == 4  # 2 steps x 2 branches, every call on the mesh
    print(f"{fam} controlnet {layout}: max rel diff {rel(got, ref):.2e}")
    assert got.shape == ref.shape and rel(got, ref) <= TOL
