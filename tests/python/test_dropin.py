"""The drop-in as a diffusers user drives it (issue 27): torch.compile, save_pretrained, attention
kwargs that change nothing, Hub ids from the local Hugging Face cache, Qwen-Image's img_shapes as
diffusers reads them. One tiny FluxPipeline (tests/python/flux_pipeline.py) and the tiny goldens
(tests/data) on one rank."""
import filecmp
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import flux_pipeline
import meshdit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLUX = os.path.join(ROOT, "tests", "data", "flux_tiny")
TOL = 1e-4
GEN = dict(seed=3, steps=2, size=64)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def golden_inputs():
    return {k: torch.from_numpy(v) for k, v in load_file(os.path.join(FLUX, "inputs.safetensors")).items()}


GOLDEN = load_file(os.path.join(FLUX, "expected.safetensors"))["sample"]


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("flux_pipe"))
    flux_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def flux_ref(flux_root):
    return flux_pipeline.generate(flux_pipeline.load(flux_root), **GEN)


@pytest.fixture(scope="module")
def mesh(flux_root):
    """The tiny pipeline's transformer on one rank."""
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer") as t:
        yield t


@pytest.fixture(scope="module")
def golden():
    """The tiny Flux golden's transformer on one rank (the METHODS checks)."""
    with meshdit.Transformer.from_pretrained(FLUX) as t:
        yield t


# ---- 1. torch.compile ---------------------------------------------------------------------------
def test_torch_compile_and_compile_in_a_pipeline(flux_root, flux_ref):
    """torch.compile(pipe.transformer) and t.compile() (diffusers' advice) run the forward on the
    mesh and give exactly the uncompiled image."""
    with meshdit.Transformer.from_pretrained(f"{flux_root}/transformer") as t:
        pipe = flux_pipeline.load(flux_root, transformer=t)
        plain = flux_pipeline.generate(pipe, **GEN)
        pipe.transformer = torch.compile(pipe.transformer)
        compiled = flux_pipeline.generate(pipe, **GEN)
        pipe.transformer = t
        t.compile()
        in_place = flux_pipeline.generate(pipe, **GEN)
        assert t.stats["forwards"] == 3 * GEN["steps"]  # every step of all three ran on the mesh
    torch._dynamo.reset()
    assert np.array_equal(compiled, plain) and np.array_equal(in_place, plain)
    assert rel(plain, flux_ref) <= TOL


# ---- 2. save_pretrained -------------------------------------------------------------------------
def same_files(a, b, names=("config.json", "diffusion_pytorch_model.safetensors")):
    return all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def test_pipeline_save_pretrained_writes_a_pipeline_that_loads(flux_root, flux_ref, mesh, tmp_path):
    """pipe.save_pretrained writes every component, the transformer as the checkpoint the mesh
    loaded (byte for byte); the saved directory generates the same image with diffusers' own
    transformer and, as its model_index.json names meshdit's class, with meshdit."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    pipe = flux_pipeline.load(flux_root, transformer=mesh)
    img = flux_pipeline.generate(pipe, **GEN)
    out = str(tmp_path / "saved")
    pipe.save_pretrained(out)
    assert same_files(f"{flux_root}/transformer", f"{out}/transformer")
    with open(f"{out}/model_index.json") as f:
        assert json.load(f)["transformer"] == ["meshdit.transformer", "FluxTransformer"]
    theirs = FluxTransformer2DModel.from_pretrained(f"{out}/transformer")
    assert np.array_equal(flux_pipeline.generate(flux_pipeline.load(out, transformer=theirs), **GEN), flux_ref)
    again = FluxPipeline.from_pretrained(out, dtype=torch.float32)
    again.set_progress_bar_config(disable=True)
    try:
        assert isinstance(again.transformer, meshdit.FluxTransformer)
        assert np.array_equal(flux_pipeline.generate(again, **GEN), img)
    finally:
        again.transformer.close()


def test_save_pretrained_copies_the_checkpoint_or_writes_nothing(mesh, flux_root, tmp_path):
    from diffusers import FluxTransformer2DModel

    mesh.save_pretrained(tmp_path / "t")
    assert same_files(f"{flux_root}/transformer", tmp_path / "t")
    FluxTransformer2DModel.from_pretrained(tmp_path / "t")  # loads in diffusers
    for kw in (dict(variant="fp16"), dict(safe_serialization=False), dict(push_to_hub=True),
               dict(max_shard_size=1000), dict(save_function=torch.save)):
        name = next(iter(kw))
        with pytest.raises(NotImplementedError, match=rf"save_pretrained\({name}="):
            mesh.save_pretrained(tmp_path / name, **kw)
        assert not (tmp_path / name).exists()
    with meshdit.Transformer.connect(mesh._client.endpoint) as other:
        with pytest.raises(meshdit.MeshditError, match=r"save_pretrained: .*connect\(\.\.\., checkpoint=DIR\)"):
            other.save_pretrained(tmp_path / "c")
        assert not (tmp_path / "c").exists()
    with meshdit.Transformer.connect(mesh._client.endpoint, checkpoint=f"{flux_root}/transformer") as other:
        other.save_pretrained(tmp_path / "c")
    assert same_files(f"{flux_root}/transformer", tmp_path / "c")


# ---- 3. attention kwargs that change nothing -----------------------------------------------------
def test_attention_kwargs_that_change_nothing_pass(flux_root, flux_ref, mesh):
    """joint_attention_kwargs={"scale": 1.0} (no LoRA scaling) is accepted and changes nothing;
    another scale or any other key is refused by name."""
    pipe = flux_pipeline.load(flux_root, transformer=mesh)
    got = flux_pipeline.generate(pipe, **GEN, joint_attention_kwargs={"scale": 1.0})
    assert rel(got, flux_ref) <= TOL
    x = golden_inputs()
    for bad, what in (({"scale": 0.5}, r"scale=0\.5"), ({"ip_adapter_image_embeds": [x["hidden_states"]]},
                                                         "'ip_adapter_image_embeds'"),
                      ({"scale": 1.0, "other": 1}, "'other'")):
        with pytest.raises(NotImplementedError, match=rf"'joint_attention_kwargs' with .*{what}"):
            flux_pipeline.generate(pipe, **GEN, joint_attention_kwargs=bad)


# ---- 5. Hub ids from the local Hugging Face cache ---------------------------------------------------
REV = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(cache, repo="meshdit-test/flux-tiny"):
    """huggingface_hub's cache layout: models--ORG--NAME/snapshots/REV/... and refs/main = REV."""
    base = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", REV, "transformer")
    os.makedirs(snap)
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        shutil.copyfile(os.path.join(FLUX, name), os.path.join(snap, name))
    os.makedirs(os.path.join(base, "refs"))
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(REV)
    return str(cache)


def test_a_hub_id_is_found_in_the_local_cache(tmp_path):
    cache = fake_cache(tmp_path / "hub")
    with meshdit.Transformer.from_pretrained("meshdit-test/flux-tiny", subfolder="transformer",
                                             cache_dir=cache) as t:
        assert rel(t(**golden_inputs()).sample.numpy(), GOLDEN) <= 2e-5
    for repo, sub in (("meshdit-test/absent", "transformer"), ("meshdit-test/flux-tiny", "vae")):
        with pytest.raises(meshdit.MeshditError) as e:
            meshdit.Transformer.from_pretrained(repo, subfolder=sub, cache_dir=cache)
        msg = str(e.value)
        assert "\n" not in msg and f"hf download {repo} --include '{sub}/*'" in msg and cache in msg


def test_a_hub_id_follows_HF_HUB_CACHE(tmp_path):
    """HF_HUB_CACHE (read by huggingface_hub when it is imported: a fresh process)."""
    cache = fake_cache(tmp_path / "hub")
    code = ("import meshdit, sys\n"
            "with meshdit.Transformer.from_pretrained('meshdit-test/flux-tiny', subfolder='transformer') as t:\n"
            "    print(t.config._class_name)\n"
            "try:\n"
            "    meshdit.Transformer.from_pretrained('black-forest-labs/FLUX.1-dev', subfolder='transformer')\n"
            "except meshdit.MeshditError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "FluxTransformer2DModel"
    assert len(lines) == 2 and "`hf download black-forest-labs/FLUX.1-dev --include 'transformer/*'`" in lines[1]
    assert cache in lines[1]


# ---- 8. Qwen-Image's img_shapes, read as diffusers reads it ---------------------------------------
@pytest.mark.parametrize("ckpt,forms", [
    ("qwenimage_tiny", [[(1, 4, 4)], (1, 4, 4), [[(1, 4, 4)]], [[(1, 4, 4)]] * 2]),
    ("qwenimage_frames", [[[(2, 2, 3), (1, 3, 3)]], [[(2, 2, 3), (1, 3, 3)]] * 2,
                          [[(2, 2, 3), (1, 3, 3)], [(1, 1, 1)]]]),
])
def test_img_shapes_as_diffusers_reads_them(ckpt, forms):
    """QwenEmbedRope uses the first entry of img_shapes for every batch element (pipelines pass
    one entry per prompt, so num_images_per_prompt=2 gives fewer entries than batch elements):
    a batch of 2 with each form equals diffusers' transformer on the same form."""
    from diffusers import QwenImageTransformer2DModel

    path = os.path.join(ROOT, "tests", "data", ckpt)
    x = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "inputs.safetensors")).items()}
    x.pop("img_shapes")
    x = {k: torch.cat([v, v.flip(-1) if v.is_floating_point() else v]) for k, v in x.items()}
    theirs = QwenImageTransformer2DModel.from_pretrained(path).eval()
    with meshdit.Transformer.from_pretrained(path) as t:
        for form in forms:
            with torch.no_grad():
                ref = theirs(**x, img_shapes=form).sample.numpy()
            if isinstance(form, list) and any(s != form[0] for s in form):
                with pytest.warns(UserWarning, match="first entry"):
                    got = t(**x, img_shapes=form).sample.numpy()
            else:
                got = t(**x, img_shapes=form).sample.numpy()
            assert got.shape == ref.shape and rel(got, ref) <= TOL, form
