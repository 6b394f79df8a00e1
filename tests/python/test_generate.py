"""`meshdit generate` and the engine under it, and the `meshdit` command (generate/api here,
every other command handed to the C binary, whose finder skips this command). Tiny pipelines
built locally (tests/python/*_pipeline.py), 2-5 steps, 64x64."""
import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import pytest
import torch

import flux_pipeline
import meshdit
from meshdit import generate as mg
from meshdit.server import find_binary
from service_util import env_with_package, levels, meshdit_cmd, pil_pixels, png_pixels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ["MESHDIT_BIN"]
TXT = 32  # max_sequence_length of every test generation (the tiny T5 takes any)


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gen") / "flux_tiny")
    flux_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def diffusers_flux(flux_root):
    return flux_pipeline.load(flux_root)


def diffusers_image(pipe, seed, **kw):
    """What the pipeline makes with diffusers' own transformer (uint8 pixels)."""
    with torch.inference_mode():
        out = pipe(generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", **kw)
    return pil_pixels(out.images[0])


def test_generate_writes_the_png_diffusers_makes(flux_root, diffusers_flux, tmp_path):
    out = tmp_path / "cube.png"
    r = subprocess.run(meshdit_cmd("generate", "--model", flux_root, "--prompt", "a red cube",
                                   "--steps", "2", "--size", "64x48", "--seed", "3", "--tp", "2",
                                   "--guidance", "4.5", "--max-sequence-length", str(TXT),
                                   "--out", str(out)),
                       capture_output=True, text=True, env=env_with_package(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    so, se = r.stdout, r.stderr
    assert "plan: model flux, world 2 = tp 2 x ring 1 x ulysses 1" in so  # the plan line
    assert "loading the transformer on 2 ranks" in so and "pipeline ready in" in so  # load progress
    assert "guidance_scale=4.5" in so  # --guidance mapped onto FLUX.1-dev's embedded guidance
    assert "step 1/2 [" in se and "step 2/2 [" in se and "s/step" in se  # the per-step bar
    assert f"wrote {out} (64x48; 2 steps" in so
    got = png_pixels(out.read_bytes())
    kw = dict(prompt="a red cube", height=48, width=64, num_inference_steps=2, guidance_scale=4.5,
              max_sequence_length=TXT)
    ref = diffusers_image(diffusers_flux, 3, **kw)
    assert got.shape == ref.shape == (48, 64, 3)
    assert levels(got, ref) <= 1, levels(got, ref)
    assert levels(diffusers_image(diffusers_flux, 4, **kw), ref) > 8  # another seed differs
    assert levels(diffusers_image(diffusers_flux, 3, **{**kw, "guidance_scale": 1.5}), ref) > 8


def test_generate_with_a_lora_a_step_cache_and_cfg2_is_diffusers_doing_the_same(
        flux_root, tmp_path):
    """--lora FILE:WEIGHT, --cache first_block:threshold=X and --cfg 2 (true CFG) at once give
    the image diffusers' own pipeline makes with load_lora_weights + set_adapters, the same
    First-Block Cache hook and true CFG. Controls: without the cache the image differs (so the
    cache skipped steps), without the LoRA too (so the adapter acts)."""
    from diffusers.hooks import FirstBlockCacheConfig
    from safetensors.torch import save_file
    from test_lora import kohya_flux

    lora = tmp_path / "style.safetensors"
    save_file(kohya_flux(seed=1, h=flux_pipeline.HEADS * flux_pipeline.HEAD_DIM, double=2,
                         single=2), str(lora))
    out = tmp_path / "x.png"
    r = subprocess.run(meshdit_cmd("generate", "--model", flux_root, "--prompt", "a red cube",
                                   "--steps", "6", "--size", "64x64", "--seed", "3", "--cfg", "2",
                                   "--true-cfg", "2", "--max-sequence-length", str(TXT),
                                   "--lora", f"{lora}:0.7", "--cache", "first_block:threshold=0.3",
                                   "--out", str(out)),
                       capture_output=True, text=True, env=env_with_package(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world 2 = cfg 2 x tp 1" in r.stdout and "LoRA 'style' from" in r.stdout, r.stdout
    assert "step cache: first_block:threshold=0.3" in r.stdout, r.stdout
    got = png_pixels(out.read_bytes())
    kw = dict(prompt="a red cube", height=64, width=64, num_inference_steps=6, guidance_scale=3.5,
              true_cfg_scale=2.0, negative_prompt="", max_sequence_length=TXT)
    pipe = flux_pipeline.load(flux_root)
    plain = diffusers_image(pipe, 3, **kw)
    pipe.load_lora_weights(str(lora), adapter_name="style")
    pipe.set_adapters(["style"], [0.7])
    uncached = diffusers_image(pipe, 3, **kw)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
    ref = diffusers_image(pipe, 3, **kw)
    assert levels(got, ref) <= 1, levels(got, ref)
    assert levels(ref, uncached) > 1 and levels(uncached, plain) > 8, (levels(ref, uncached),
                                                                        levels(uncached, plain))


def test_generate_refuses_in_one_line(flux_root, tmp_path):
    """Usage errors (exit 2) and a model that is not there (exit 1): one line each, before any
    pipeline is loaded."""
    env = env_with_package({"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    broken_index, list_class = str(tmp_path / "broken"), str(tmp_path / "listclass")
    for d, text in ((broken_index, "{oops"), (list_class, '{"_class_name": ["x"]}')):
        os.makedirs(d)
        with open(os.path.join(d, "model_index.json"), "w") as f:
            f.write(text)
    cases = [(["--model", flux_root, "--prompt", "x", "--size", "64"], 2, "'64' is not WIDTHxHEIGHT"),
             (["--model", flux_root, "--prompt", "x", "--out", "a.jpg"], 2, "must end in .png or .mp4"),
             (["--model", flux_root], 2, "--prompt"),
             (["--model", flux_root, "--prompt", "x", "--size", "+64x64"], 2, "is not WIDTHxHEIGHT"),
             (["--model", flux_root, "--prompt", "x", "--max-sequence-length", "1000"], 2,
              "--max-sequence-length: max_sequence_length 1000: FluxPipeline takes 1 to 512"),
             (["--model", flux_root, "--prompt", "x", "--guidance", "nan"], 2,
              "--guidance: guidance nan: must be a finite number"),
             (["--model", "someorg/not-cached", "--prompt", "x"], 1,
              "not in the local Hugging Face cache: download it first"),
             (["--model", str(tmp_path), "--prompt", "x"], 1, "has no model_index.json"),
             # where the picture goes is checked before any work, not after the generation
             (["--model", flux_root, "--prompt", "x", "--out", str(tmp_path / "no" / "a.png")], 2,
              "--out: no directory"),
             (["--model", flux_root, "--prompt", "x", "--out", str(tmp_path / "d.png")], 2,
              "is a directory"),
             # an option given twice: argparse kept the last one, silently
             (["--model", flux_root, "--prompt", "x", "--seed", "1", "--seed", "2"], 2,
              "--seed given twice"),
             (["--model", broken_index, "--prompt", "x"], 1, "model_index.json: Expecting"),
             (["--model", list_class, "--prompt", "x"], 1, "is not one meshdit generates with"),
             (["--model", flux_root, "--prompt", "x", "--lora", "no.safetensors:0.5"], 2,
              "--lora no.safetensors:0.5: no file no.safetensors"),
             (["--model", flux_root, "--prompt", "x", "--cache", "first_block:thr=1"], 2,
              "'thr=1': no such field of FirstBlockCacheConfig"),
             (["--model", flux_root, "--prompt", "x", "--cache", "later"], 2, "unknown cache 'later'"),
             (["--model", flux_root, "--prompt", "x", "--lora-2", "no.safetensors"], 2,
              "--lora-2 no.safetensors: no file"),
             (["--model", flux_root, "--prompt", "x", "--lora-2", __file__], 2,
              "--lora-2: FluxPipeline here has no transformer_2"),
             # values the server refuses: refused here, not by every forward of the generation
             (["--model", flux_root, "--prompt", "x", "--cache", "taylorseer:cache_interval=0"], 2,
              "cache_interval=0 is not in [1, 1048576]"),
             (["--model", flux_root, "--prompt", "x", "--cache", "mag:mag_ratios=nan/1"], 2,
              "mag_ratios must be 1 to 1024 finite numbers"),
             (["--model", flux_root, "--prompt", "x", "--cfg", "3"], 2, "invalid choice: 3")]
    (tmp_path / "d.png").mkdir()
    for args, rc, msg in cases:
        r = subprocess.run(meshdit_cmd("generate", *args), capture_output=True, text=True, env=env,
                           timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == rc and len(lines) == 1 and msg in lines[0], (args, r.stderr)


def test_generate_refuses_after_the_load_in_one_line(flux_root, tmp_path):
    """What needs the pipeline: --fps for an image pipeline (it was ignored), a component's folder
    missing (diffusers' OSError was a traceback). One line, exit 2 / 1, no file written."""
    env = env_with_package()
    no_vae = str(tmp_path / "no_vae")
    shutil.copytree(flux_root, no_vae)
    shutil.rmtree(os.path.join(no_vae, "vae"))
    out = str(tmp_path / "x.png")
    for args, rc, msg in [(["--model", flux_root, "--fps", "8"], 2, "--fps: FluxPipeline makes images"),
                          (["--model", flux_root, "--cache", "text_kv"], 1,
                           "--cache: TextKVCacheConfig is not implemented for FluxTransformer2DModel"),
                          (["--model", no_vae], 1, f"cannot load the pipeline from {no_vae}")]:
        r = subprocess.run(meshdit_cmd("generate", *args, "--prompt", "x", "--steps", "1",
                                       "--size", "64x64", "--out", out),
                           capture_output=True, text=True, env=env, timeout=300)
        errs = [ln for ln in r.stderr.splitlines() if ln.startswith("meshdit") or "Traceback" in ln]
        assert r.returncode == rc and len(errs) == 1 and msg in errs[0], (args, r.stderr)
        assert not os.path.exists(out)


def test_engine_lora_weights_per_request(flux_root, tmp_path):
    """An engine with a --lora adapter: a request without `loras` runs the loaded weight, one
    with {name: w} that weight, one with {} no adapter: each the image diffusers makes with
    set_adapters at that weight (or none). Unknown names and bad weights are refused."""
    from safetensors.torch import save_file
    from test_lora import kohya_flux

    lora = tmp_path / "style.safetensors"
    save_file(kohya_flux(seed=2, h=flux_pipeline.HEADS * flux_pipeline.HEAD_DIM, double=2,
                         single=2), str(lora))
    kw = dict(prompt="a red cube", height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
              max_sequence_length=TXT)
    pipe = flux_pipeline.load(flux_root)
    want = {"none": diffusers_image(pipe, 3, **kw)}
    pipe.load_lora_weights(str(lora), adapter_name="style")
    for w in (0.7, 0.3):
        pipe.set_adapters(["style"], [w])
        want[w] = diffusers_image(pipe, 3, **kw)
    e = mg.Engine(flux_root, tp=1, log=lambda line: None, loras=[(str(lora), 0.7)])
    try:
        assert e.loras == [{"name": "style", "file": str(lora), "weight": 0.7,
                            "transformer": "transformer"}]
        for loras, key in ((None, 0.7), ({"style": 0.3}, 0.3), ({}, "none"), (None, 0.7)):
            res = e.run(req(loras=loras))
            assert res.loras == {"style": 0.7 if key == 0.7 else 0.3 if key == 0.3 else 0.0}
            assert levels(pil_pixels(res.images[0]), want[key]) <= 1, (loras, key)
        assert levels(want[0.7], want["none"]) > 8 and levels(want[0.7], want[0.3]) > 8
        for bad, msg in (({"other": 1.0}, "no adapter 'other' \\(loaded: style\\)"),
                         ({"style": float("nan")}, "finite"), ({"style": True}, "finite"),
                         (["style"], "must be an object")):
            with pytest.raises(mg.RequestError, match=msg) as err:
                e.check(req(loras=bad))
            assert err.value.param == "lora"
    finally:
        e.close()


def test_wan22_a14b_runs_both_experts_as_diffusers_does(tmp_path):
    """A WanPipeline with transformer_2 (Wan 2.2 A14B's low-noise expert): each expert on a mesh
    of its own, the frames equal diffusers' own pipeline's with both experts; a step cache goes
    on both. Control: the frames differ from transformer alone (the second expert ran)."""
    import wan_pipeline
    from diffusers import WanPipeline
    from diffusers.hooks import FirstBlockCacheConfig

    root = str(tmp_path / "wan22")
    wan_pipeline.build_a14b(root, seed=0, boundary_ratio=0.6)
    r = mg.Request(prompt=wan_pipeline.PROMPT, negative_prompt=wan_pipeline.NEGATIVE_PROMPT, steps=4,
                   width=48, height=32, frames=5, seed=7, max_sequence_length=wan_pipeline.TXT_LEN)
    ref = WanPipeline.from_pretrained(root, torch_dtype=torch.float32)
    lines, got = [], []
    for cache in (None, FirstBlockCacheConfig(threshold=0.2)):
        e = mg.Engine(root, ulysses=2, log=lines.append, cache=cache)
        try:
            assert e.transformer_2 is not None and len(e.transformers) == 2
            res = e.run(r)
        finally:
            e.close()
        for t in (ref.transformer, ref.transformer_2):
            if cache is not None and not t.is_cache_enabled:
                t.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        kw = {k: v for k, v in res.pipeline_kwargs.items() if k != "output_type"}
        with torch.inference_mode():
            want = ref(**kw, generator=torch.Generator("cpu").manual_seed(7), output_type="np").frames[0]
        err = float(np.abs(res.frames - want).max())
        assert err < 1e-4, (cache, err)
        got.append(res.frames)
    assert float(np.abs(got[0] - got[1]).max()) > 1e-3  # the cache skipped steps
    assert any(ln.startswith("loading transformer_2") for ln in lines), lines
    one = WanPipeline.from_pretrained(root, torch_dtype=torch.float32)
    one.transformer_2, one.config.boundary_ratio = None, None  # the high-noise expert alone
    one.register_to_config(boundary_ratio=None)
    with torch.inference_mode():
        alone = one(**kw, generator=torch.Generator("cpu").manual_seed(7), output_type="np").frames[0]
    assert float(np.abs(alone - want).max()) > 1e-2


def _as_pipeline(flux_root, tmp_path, cls):
    """flux_root's components under another FLUX.1 pipeline class (they share every one)."""
    root = tmp_path / cls
    shutil.copytree(flux_root, root)
    with open(root / "model_index.json") as f:
        index = json.load(f)
    with open(root / "model_index.json", "w") as f:
        json.dump({**index, "_class_name": cls}, f)
    return str(root)


def test_read_image_as_diffusers_reads_a_file(tmp_path):
    """read_image: the EXIF orientation applied (diffusers' load_image does); a mask with
    transparent pixels read as OpenAI's (transparent: edit, made white), an opaque RGBA mask as
    diffusers' (white repaints); a size over the limit refused before it is decoded."""
    from PIL import Image
    left = Image.new("L", (80, 48), 0)
    left.paste(255, (0, 0, 40, 48))
    opaque = Image.merge("RGBA", [left, left, left, Image.new("L", (80, 48), 255)])
    openai_mask = Image.new("RGBA", (80, 48), (0, 0, 0, 255))
    openai_mask.paste((0, 0, 0, 0), (0, 0, 40, 48))
    for pic, name in ((opaque, "opaque.png"), (openai_mask, "openai.png")):
        pic.save(tmp_path / name)
        got = mg.read_image(str(tmp_path / name), "L")
        assert np.array_equal(np.asarray(got), np.asarray(left)), name  # left half white
    photo = Image.new("RGB", (48, 80), (10, 200, 30))  # stored 48x80, shown 80x48 (EXIF 6)
    exif = photo.getexif()
    exif[0x0112] = 6
    photo.save(tmp_path / "rot.jpg", exif=exif)
    assert mg.read_image(str(tmp_path / "rot.jpg"), "RGB").size == (80, 48)
    with pytest.raises(meshdit.MeshditError, match="80x48 is over the 1,000 pixels"):
        mg.read_image((tmp_path / "openai.png").read_bytes(), "RGB", "'image'", max_pixels=1000)
    with pytest.raises(meshdit.MeshditError, match="nothing.png: no such file"):
        mg.read_image(str(tmp_path / "nothing.png"), "RGB")


@pytest.mark.parametrize("cls", ["FluxKontextPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"])
def test_edit_pipelines_equal_diffusers(flux_root, tmp_path, cls):
    """An input image (and the inpaint mask, strength): the engine's image is the one diffusers'
    own pipeline makes with the same call; another input image makes another picture."""
    import diffusers
    from PIL import Image

    rng = np.random.RandomState(0)
    img = Image.fromarray((rng.rand(48, 80, 3) * 255).astype(np.uint8))
    other = Image.new("RGB", (80, 48), (255, 255, 0))  # (random noise of another seed looks alike)
    mask = Image.fromarray(((rng.rand(48, 80) > 0.5) * 255).astype(np.uint8))
    root = _as_pipeline(flux_root, tmp_path, cls)
    e = mg.Engine(root, tp=1, log=lambda line: None)
    try:
        r = mg.Request(prompt="a red cube", steps=3, seed=5, max_sequence_length=TXT, images=[img],
                       mask=mask if cls == "FluxInpaintPipeline" else None)
        seen = []
        e.transformer.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
        res = e.run(r)
        assert (res.width, res.height) == (80, 48)  # the input image's size
        # Kontext: the image's tokens travel with the 15 of the picture (Img2Img and Inpaint
        # start from the image's latents instead)
        assert (min(seen) > 15) == (cls == "FluxKontextPipeline"), seen
        kw = e.pipeline_kwargs(e.check(r))
        assert res.pipeline_kwargs["image"] == "image 80x48 RGB"
        res2 = e.run(dataclasses.replace(r, images=[other]))
        if cls != "FluxKontextPipeline":  # a batch draws every start from the first seed
            with pytest.raises(mg.RequestError, match="makes one image a request"):
                e.check(dataclasses.replace(r, n=2))
        big = dataclasses.replace(r, images=[img.resize((800, 480))],  # over the limit: scaled
                                  mask=r.mask and r.mask.resize((800, 480)))
        assert (lambda c: (c.width, c.height))(e.check(big, max_pixels=100_000)) == (400, 240)
    finally:
        e.close()
    ref = getattr(diffusers, cls).from_pretrained(root, torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    want = diffusers_image(ref, 5, **{k: v for k, v in kw.items() if k != "output_type"})
    got = pil_pixels(res.images[0])
    assert got.shape == want.shape == (48, 80, 3)
    assert levels(got, want) <= 1, levels(got, want)
    # another input image, another picture (Kontext's weak here: a tiny random transformer)
    assert levels(pil_pixels(res2.images[0]), got) > (2 if cls == "FluxKontextPipeline" else 8)



@pytest.mark.parametrize("cls", ["QwenImageEditPlusPipeline", "QwenImageEditPipeline"])
def test_qwen_edit_equals_diffusers(tmp_path, cls):
    """Qwen-Image-Edit's pipelines (the transformer Qwen-Image-Edit-2511's, zero_cond_t) on
    ulysses2: the engine's image is the one diffusers' own pipeline makes with the same call; an
    image is required (the Plus pipeline takes 1 to 4, the other one), and without a size the
    image diffusers takes the aspect from (the Plus pipeline's last) gives it."""
    import json
    from unittest import mock

    import qwenimage_edit_pipeline as qe
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module
    from PIL import Image

    root = str(tmp_path / "qwen_edit")
    qe.build(root, seed=0)
    with open(f"{root}/model_index.json") as f:
        index = json.load(f)
    index["_class_name"] = cls  # the same components
    with open(f"{root}/model_index.json", "w") as f:
        json.dump(index, f)
    plus = cls == "QwenImageEditPlusPipeline"
    imgs = qe.reference_images() if plus else qe.reference_images()[:1]  # 96x64, then 64x96
    # the tiny pipeline's condition image areas (QwenImageEditPipeline sizes its image to a
    # megapixel with this function; the Plus pipeline's are module constants)
    dims = edit_module.calculate_dimensions
    with qe.condition_areas(), mock.patch.object(
            edit_module, "calculate_dimensions", lambda area, ratio: dims(qe.VAE_AREA, ratio)):
        e = mg.Engine(root, ulysses=2, log=lambda line: None)
        try:
            r = mg.Request(prompt=qe.PROMPT, negative_prompt=qe.NEGATIVE_PROMPT,
                           guidance=qe.TRUE_CFG_SCALE, steps=2, seed=5, images=imgs, width=64,
                           height=64)
            seen = []
            e.transformer.register_forward_pre_hook(
                lambda m, a, kw: seen.append(kw["img_shapes"]), with_kwargs=True)
            res = e.run(r)
            assert seen and all(len(s[0]) == 1 + len(imgs) for s in seen), seen
            kw = e.pipeline_kwargs(e.check(r))
            assert kw["true_cfg_scale"] == qe.TRUE_CFG_SCALE
            assert kw["image"] == (imgs if plus else imgs[0])
            yellow = Image.new("RGB", (96, 64), (255, 255, 0))
            res2 = e.run(dataclasses.replace(r, images=imgs[:1] if plus else [yellow]))
            with pytest.raises(mg.RequestError, match="needs an input image"):
                e.check(dataclasses.replace(r, images=None))
            many = qe.reference_images() * 3
            with pytest.raises(mg.RequestError, match="5 input images: .* takes 1 to 4" if plus
                               else "2 input images: .* takes one"):
                e.check(dataclasses.replace(r, images=many[:5] if plus else many[:2]))
            c = e.check(dataclasses.replace(r, width=None, height=None))
            assert (c.width, c.height) == ((64, 96) if plus else (96, 64))
            # an image so elongated that the pipeline's resize gives it a side of 0 (diffusers
            # fails with "height and width must be > 0" after the mesh started)
            thin = Image.new("RGB", (800, 8), (0, 0, 255))
            with pytest.raises(mg.RequestError, match="input image 1 is 800x8: .*too elongated"):
                e.check(dataclasses.replace(r, images=[thin] + imgs[1:]))
            # a PIL image in another mode is read as load_image reads a file: RGB
            rgba = e.check(dataclasses.replace(r, images=[im.convert("RGBA") for im in imgs]))
            assert [im.mode for im in rgba.images] == ["RGB"] * len(imgs)
            assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(rgba.images, imgs))
            with pytest.raises(mg.RequestError, match="width 16400: at most 16384"):
                e.check(dataclasses.replace(r, width=16400))
        finally:
            e.close()
        ref = getattr(__import__("diffusers"), cls).from_pretrained(root, torch_dtype=torch.float32)
        ref.set_progress_bar_config(disable=True)
        want = diffusers_image(ref, 5, **{k: v for k, v in kw.items() if k != "output_type"})
    got = pil_pixels(res.images[0])
    assert got.shape == want.shape == (64, 64, 3)
    assert levels(got, want) <= 1, levels(got, want)
    print(f"{cls}: other input images: {levels(pil_pixels(res2.images[0]), got)} levels")
    assert levels(pil_pixels(res2.images[0]), got) > 8  # other input images, another picture

def _wan_lora(path, seed, targets):
    """A peft LoRA of the tiny Wan transformer on `targets`, saved as WanPipeline saves one
    (random B: it acts)."""
    import wan_pipeline
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    t = WanTransformer3DModel(**wan_pipeline.TRANSFORMER_CONFIG)
    t.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for n, p in t.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    WanPipeline.save_lora_weights(str(path), transformer_lora_layers=get_peft_model_state_dict(t),
                                  weight_name="lora.safetensors")
    return str(path / "lora.safetensors")


def test_wan22_a14b_takes_a_lora_for_each_expert(tmp_path):
    """--lora goes into the transformer (the high-noise expert), --lora-2 into transformer_2
    (diffusers' load_into_transformer_2=True): the frames equal diffusers' pipeline doing the same
    loads and set_adapters; each file changes them. --lora-2 without a transformer_2 is refused."""
    import wan_pipeline
    from diffusers import WanPipeline

    root = str(tmp_path / "wan22")
    wan_pipeline.build_a14b(root, seed=0, boundary_ratio=0.6)
    hi = _wan_lora(tmp_path / "hi", 1, ["to_q", "to_v", "ffn.net.2"])
    lo = _wan_lora(tmp_path / "lo", 2, ["to_k", "to_out.0", "ffn.net.0.proj"])
    r = mg.Request(prompt=wan_pipeline.PROMPT, negative_prompt=wan_pipeline.NEGATIVE_PROMPT, steps=4,
                   width=48, height=32, frames=5, seed=7, max_sequence_length=wan_pipeline.TXT_LEN)
    e = mg.Engine(root, tp=1, log=lambda line: None, loras=[(hi, 0.8)], loras_2=[(lo, 1.2)])
    try:
        assert [(a["name"], a["transformer"]) for a in e.loras] == [("lora", "transformer"),
                                                                   ("lora-2", "transformer_2")]
        cases = (None, {"lora": 0.8}, {"lora-2": 1.2})  # --lora's weights, each file alone
        got = [e.run(dataclasses.replace(r, loras=w)).frames for w in cases]
        kw = {k: v for k, v in e.run(r).pipeline_kwargs.items() if k != "output_type"}
    finally:
        e.close()
    ref = WanPipeline.from_pretrained(root, torch_dtype=torch.float32)
    ref.load_lora_weights(hi, adapter_name="lora")
    ref.load_lora_weights(lo, adapter_name="lora-2", load_into_transformer_2=True)
    for k, weights in enumerate(([0.8, 1.2], [0.8, 0.0], [0.0, 1.2])):
        ref.set_adapters(["lora", "lora-2"], weights)
        with torch.inference_mode():
            want = ref(**kw, generator=torch.Generator("cpu").manual_seed(7), output_type="np").frames[0]
        assert float(np.abs(got[k] - want).max()) < 1e-4, cases[k]
    for k in (1, 2):  # each expert's file acts
        assert float(np.abs(got[0] - got[k]).max()) > 1e-3, cases[k]
    with pytest.raises(meshdit.MeshditError, match="--lora-2: WanPipeline here has no transformer_2"):
        plain = str(tmp_path / "wan21")
        wan_pipeline.build(plain, seed=0)
        mg.Engine(plain, tp=1, log=lambda line: None, loras_2=[(lo, 1.0)])


def test_hub_id_from_the_local_cache(flux_root, tmp_path, monkeypatch):
    """A hub id resolves to its snapshot in the Hugging Face cache; never a download."""
    from huggingface_hub import constants
    hub = tmp_path / "hub"
    snap = hub / "models--someorg--flux-tiny" / "snapshots" / "0123abcd"
    shutil.copytree(flux_root, snap)
    (hub / "models--someorg--flux-tiny" / "refs").mkdir()
    (hub / "models--someorg--flux-tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    assert mg.resolve_model("someorg/flux-tiny") == str(snap)
    with pytest.raises(meshdit.MeshditError, match="download it first"):
        mg.resolve_model("someorg/other")


# ---- the engine in this process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(flux_root):
    e = mg.Engine(flux_root, tp=1, log=lambda line: None)
    yield e
    e.close()


def req(**kw):
    return mg.Request(**{"prompt": "a red cube", "steps": 2, "width": 64, "height": 64,
                         "max_sequence_length": TXT, "seed": 3, **kw})


@pytest.mark.parametrize("kw,param,msg", [
    (dict(width=72), "size", "multiple of 16"), (dict(steps=0), "steps", "steps 0"),
    (dict(n=5), "n", "n 5"), (dict(frames=5), "frames", "makes images"),
    (dict(prompt=" "), "prompt", "non-empty"), (dict(guidance=-1.0), "guidance", ">= 0"),
    (dict(negative_prompt="blue"), "negative_prompt", "needs true CFG"),
    (dict(true_cfg=1.0), "true_cfg", "must be > 1"), (dict(width=4096, height=4096), "size", "pixels"),
    (dict(true_cfg=float("nan")), "true_cfg", "finite"), (dict(guidance=1e38), "guidance", "at most"),
    (dict(guidance=float("inf")), "guidance", "finite"),
    (dict(max_sequence_length=513), "max_sequence_length", "1 to 512"),
    (dict(prompt="a \ud800"), "prompt", "valid Unicode"),
    (dict(negative_prompt="\udc80", true_cfg=2.0), "negative_prompt", "valid Unicode"),
    (dict(preview_every=3), "preview_every", "over the 2 steps, no preview"),
    (dict(seed=2 ** 63 - 1), "seed", f"must be 0 to {2 ** 63 - 2} "),
])
def test_engine_refuses_naming_the_field(engine, kw, param, msg):
    with pytest.raises(mg.RequestError, match=msg) as e:
        engine.check(req(**kw), max_pixels=1 << 20, max_n=4, max_steps=50)
    assert e.value.param == param


def test_engine_batch_images_follow_their_seeds(engine, diffusers_flux):
    """n images are one batch, image k from seed + k: each equals a single image of its seed."""
    res = engine.run(req(n=2, seed=7))
    assert res.seeds == [7, 8] and len(res.images) == 2 and len(res.step_seconds) == 2
    kw = dict(prompt="a red cube", height=64, width=64, num_inference_steps=2,
              guidance_scale=3.5, max_sequence_length=TXT)
    for img, seed in zip(res.images, res.seeds):
        assert levels(pil_pixels(img), diffusers_image(diffusers_flux, seed, **kw)) <= 1
    assert levels(pil_pixels(res.images[0]), pil_pixels(res.images[1])) > 8


def test_engine_true_cfg_uses_the_negative_prompt(engine, diffusers_flux):
    res = engine.run(req(true_cfg=2.0, negative_prompt="a blue ball"))
    assert res.pipeline_kwargs["true_cfg_scale"] == 2.0
    assert res.pipeline_kwargs["negative_prompt"] == "a blue ball"
    kw = dict(prompt="a red cube", height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
              max_sequence_length=TXT, true_cfg_scale=2.0, negative_prompt="a blue ball")
    ref = diffusers_image(diffusers_flux, 3, **kw)
    assert levels(pil_pixels(res.images[0]), ref) <= 1
    other = diffusers_image(diffusers_flux, 3, **{**kw, "negative_prompt": "a green tree"})
    assert levels(other, ref) > 8  # the negative prompt matters


def test_engine_previews_and_cancel(engine):
    """A preview every step is the predicted final image x0 = x_t - sigma v: after the last step
    it is the image itself; cancel stops between two steps."""
    seen = []
    res = engine.run(req(steps=3, preview_every=1), on_event=lambda n, **d: seen.append((n, d)))
    names = [n for n, _ in seen]
    assert names == ["start"] + ["step", "preview"] * 3
    previews = [d["images"][0] for n, d in seen if n == "preview"]
    final = pil_pixels(res.images[0])
    assert levels(pil_pixels(previews[-1]), final) == 0
    assert levels(pil_pixels(previews[0]), final) > 8  # an early prediction is not the image
    import threading
    stop = threading.Event()

    def on(name, **d):
        if name == "step" and d["step"] == 2:
            stop.set()
    steps = []
    with pytest.raises(mg.Cancelled):
        engine.run(req(steps=5), on_event=lambda n, **d: (steps.append(n), on(n, **d)), cancel=stop)
    assert steps.count("step") == 2  # stopped after step 2 of 5
    assert engine.run(req()).images  # and the engine goes on


class _Stub:
    """Just what Engine._guidance_kwargs reads: a pipeline class's __call__ defaults and the
    transformer's/pipeline's config."""

    def __init__(self, name, guidance_embeds=False, is_distilled=False):
        import diffusers
        self.class_name = name
        self._sig = inspect.signature(getattr(diffusers, name).__call__).parameters
        self.pipe = type("P", (), {})()
        self.pipe.transformer = type("T", (), {"config": {"guidance_embeds": guidance_embeds}})()
        self.pipe.config = type("C", (), {"is_distilled": is_distilled})()

    def kw(self, **r):
        return mg.Engine._guidance_kwargs(self, req(**r))


def test_guidance_maps_onto_each_pipelines_argument():
    """--guidance is the family's own argument (docs/service.md); combinations a pipeline would
    ignore are refused."""
    dev = _Stub("FluxPipeline", guidance_embeds=True)
    assert dev.kw(guidance=4.0) == {"guidance_scale": 4.0}
    assert dev.kw(guidance=4.0, true_cfg=3.0, negative_prompt="n") == {
        "guidance_scale": 4.0, "true_cfg_scale": 3.0, "negative_prompt": "n"}
    schnell = _Stub("FluxPipeline", guidance_embeds=False)  # no embedding: true CFG
    assert schnell.kw(guidance=3.0) == {"true_cfg_scale": 3.0, "negative_prompt": ""}
    assert schnell.kw() == {"true_cfg_scale": 1.0}
    with pytest.raises(mg.RequestError, match="needs guidance > 1"):
        schnell.kw(negative_prompt="n")
    with pytest.raises(mg.RequestError, match="true_cfg applies"):
        schnell.kw(true_cfg=2.0)
    qwen = _Stub("QwenImagePipeline")
    assert qwen.kw() == {"true_cfg_scale": 4.0, "negative_prompt": ""}  # its default, with CFG
    assert qwen.kw(guidance=2.5, negative_prompt="n") == {"true_cfg_scale": 2.5, "negative_prompt": "n"}
    wan = _Stub("WanPipeline")
    assert wan.kw() == {"guidance_scale": 5.0}
    assert wan.kw(guidance=6.0, negative_prompt="n") == {"guidance_scale": 6.0, "negative_prompt": "n"}
    with pytest.raises(mg.RequestError, match="needs guidance > 1"):
        wan.kw(guidance=1.0, negative_prompt="n")
    f2 = _Stub("Flux2Pipeline")
    assert f2.kw(guidance=2.0) == {"guidance_scale": 2.0}
    with pytest.raises(mg.RequestError, match="takes no negative prompt"):
        f2.kw(negative_prompt="n")
    klein = _Stub("Flux2KleinPipeline")
    assert klein.kw(guidance=3.0, negative_prompt="n") == {"guidance_scale": 3.0, "negative_prompt": "n"}
    with pytest.raises(mg.RequestError, match="step-distilled"):
        _Stub("Flux2KleinPipeline", is_distilled=True).kw(guidance=3.0)


# ---- the command: generate/api here, the rest to the C binary -----------------------------------
@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install ./python` into a folder: the console script pip writes."""
    target = tmp_path_factory.mktemp("installed")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--disable-pip-version-check", "--target",
                        str(target), os.path.join(ROOT, "python")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    script = target / "bin" / "meshdit"
    assert script.is_file() and b"meshdit.__main__" in script.read_bytes()
    return target


def test_pyproject_declares_the_command_and_the_serve_extra():
    with open(os.path.join(ROOT, "python", "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    assert proj["scripts"]["meshdit"] == "meshdit.__main__:main"
    serve = " ".join(proj["optional-dependencies"]["serve"])
    for pkg in ("fastapi", "uvicorn", "imageio-ffmpeg", "pillow", "diffusers", "peft"):
        assert pkg in serve


def test_the_command_hands_other_subcommands_to_the_c_binary(installed, tmp_path, monkeypatch):
    """The installed `meshdit` ahead of the C binary on PATH: find_binary skips it, and
    `meshdit inspect` run through it is the C binary's inspect."""
    cbin = tmp_path / "cbin"
    cbin.mkdir()
    os.symlink(BIN, cbin / "meshdit")
    script = str(installed / "bin" / "meshdit")
    path = os.pathsep.join([str(installed / "bin"), str(cbin), os.environ.get("PATH", "")])
    monkeypatch.delenv("MESHDIT_BIN")
    monkeypatch.setenv("PATH", path)
    assert find_binary() == str(cbin / "meshdit")
    with pytest.raises(meshdit.MeshditError, match="is the Python meshdit command"):
        find_binary(script)
    env = {k: v for k, v in os.environ.items() if k != "MESHDIT_BIN"}
    env.update(PATH=path, PYTHONPATH=str(installed))
    ck = os.path.join(ROOT, "tests", "data", "flux_tiny")
    direct = subprocess.run([BIN, "inspect", "--checkpoint", ck, "--tp", "2"], capture_output=True,
                            text=True, timeout=60)
    via = subprocess.run(["meshdit", "inspect", "--checkpoint", ck, "--tp", "2"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert via.returncode == direct.returncode == 0 and via.stdout == direct.stdout != ""
    bad = subprocess.run(["meshdit", "inspect", "--checkpoint", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode != 0 and bad.stderr.startswith("meshdit: ")  # the C binary's own line
    usage = subprocess.run(["meshdit", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert usage.returncode == 0 and "meshdit generate" in usage.stdout and "meshdit api" in usage.stdout
    alone = subprocess.run([script, "run"], capture_output=True, text=True, timeout=60,
                           env={**env, "PATH": str(installed / "bin")})
    assert alone.returncode == 1 and "is a command of the C binary" in alone.stderr
