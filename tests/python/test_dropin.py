"""The drop-in as a diffusers user drives it (issue 27): torch.compile, save_pretrained, every
public method of a diffusers transformer either working or refused by name (the table
`meshdit.transformer.METHODS`), attention kwargs that change nothing, Hub ids from the local
Hugging Face cache, Qwen-Image's img_shapes as diffusers reads them, and the messages and
documents around them. One tiny FluxPipeline (tests/python/flux_pipeline.py) and the tiny
goldens (tests/data) on one rank."""
import ast
import filecmp
import importlib.machinery
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import flux_pipeline
import meshdit
from meshdit.transformer import METHODS

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
    assert FluxTransformer2DModel.from_pretrained(tmp_path / "t").num_parameters() == mesh.num_parameters()
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


# ---- 3. every method of a diffusers transformer: works, or NotImplementedError naming it ------------
def _families():
    import diffusers
    return [diffusers.FluxTransformer2DModel, diffusers.Flux2Transformer2DModel,
            diffusers.QwenImageTransformer2DModel, diffusers.WanTransformer3DModel,
            diffusers.MiniMaxH3Transformer3DModel]


def test_the_table_names_every_public_method_of_diffusers_transformers():
    kinds = (types.FunctionType, classmethod, staticmethod, property)

    def own(a):  # torch's or diffusers' (not a method another library patched onto Module)
        f = a.fget if isinstance(a, property) else getattr(a, "__func__", a)
        return f.__module__.split(".")[0] in ("torch", "diffusers")

    names = {n for cls in _families() + [torch.nn.Module] for n in dir(cls)
             if not n.startswith("_") and isinstance(inspect.getattr_static(cls, n), kinds)
             and own(inspect.getattr_static(cls, n))}
    assert not names - set(METHODS), sorted(names - set(METHODS))
    assert set(WORKS) == {n for n, (v, _) in METHODS.items() if v == "works"}
    assert {v for v, _ in METHODS.values()} == {"works", "refused"}


@pytest.mark.parametrize("name", sorted(n for n, (v, _) in METHODS.items() if v == "refused"))
def test_a_refused_method_names_itself(golden, name):
    for target in (golden, type(golden)):
        with pytest.raises(NotImplementedError, match=rf"^meshdit: {re.escape(name)}\(\) is not supported: "):
            getattr(target, name)()


def _forward_equal(t):
    return np.array_equal(t(**golden_inputs()).sample.numpy(), FORWARD[0])


FORWARD = []  # the golden transformer's first forward, set by the "forward" check


def _check_forward(t):
    out = t(**golden_inputs())
    assert rel(out.sample.numpy(), GOLDEN) <= 2e-5
    FORWARD[:] = [out.sample.numpy()]


def _check_dtype_device(t):
    for call, want in (("half", torch.float16), ("bfloat16", torch.bfloat16), ("double", torch.float64),
                       ("float", torch.float32)):
        assert getattr(t, call)() is t and t.dtype == want
    assert t.type(torch.float16) is t and t.dtype == torch.float16
    assert t.to(torch.float32) is t and t.dtype == torch.float32
    for call in ("cuda", "xpu", "ipu", "mtia"):
        assert getattr(t, call)() is t and t.device.type == call
    assert t.to_empty(device="meta") is t and t.device.type == "meta"
    assert t.cpu() is t and t.device == torch.device("cpu")
    out = t(**{k: v.half() if v.is_floating_point() else v for k, v in golden_inputs().items()}).sample
    assert out.dtype == torch.float16  # outputs follow hidden_states


def _check_save(t, tmp):
    t.save_pretrained(tmp / "s")
    assert same_files(FLUX, tmp / "s")


def _check_save_config(t, tmp):
    t.save_config(tmp / "c")
    t.to_json_file(tmp / "j.json")
    for p in (tmp / "c" / "config.json", tmp / "j.json"):
        with open(p) as f:
            assert json.load(f) == dict(t.config) == json.loads(t.to_json_string())


def _check_hooks(t):
    seen = []
    h1 = t.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    h2 = t.register_forward_hook(lambda m, args, kwargs, out: seen.append(out.sample.shape), with_kwargs=True)
    _forward_equal(t)
    h1.remove(), h2.remove()
    assert seen == [sorted(golden_inputs()), torch.Size(GOLDEN.shape)]


def _check_compile(t):
    t.compile()
    try:
        assert _forward_equal(t)
    finally:
        t._compiled_call_impl = None
        torch._dynamo.reset()
    assert t.compile_repeated_blocks(fullgraph=True) is None and _forward_equal(t)


def _check_train(t):
    assert t.eval() is t and t.train(False) is t and not t.training
    with pytest.raises(NotImplementedError, match=r"train\(True\)"):
        t.train()
    assert t.requires_grad_(False) is t
    with pytest.raises(NotImplementedError, match=r"requires_grad_\(True\)"):
        t.requires_grad_()
    assert t.zero_grad() is None and not t.training


def _check_tree(t):
    assert list(t.modules()) == [t] and list(t.named_modules()) == [("", t)]
    assert list(t.children()) == list(t.named_children()) == []
    assert list(t.parameters()) == list(t.named_parameters()) == []
    assert list(t.buffers()) == list(t.named_buffers()) == []
    assert t.get_submodule("") is t
    for call in ("get_parameter", "get_buffer", "get_submodule"):
        with pytest.raises(AttributeError):
            getattr(t, call)("transformer_blocks.0")
    seen = []
    assert t.apply(seen.append) is t and seen == [t]
    assert t.share_memory() is t and t.extra_repr() == ""


def _check_num_parameters(t):
    from diffusers import FluxTransformer2DModel
    assert t.num_parameters() == FluxTransformer2DModel.from_pretrained(FLUX).num_parameters() > 0
    for k in ("only_trainable", "exclude_embeddings"):
        with pytest.raises(NotImplementedError, match=rf"num_parameters\({k}=True\)"):
            t.num_parameters(**{k: True})


def _check_attention_backend(t):
    t.set_attention_backend("native")
    assert t.attention_backend == "native" and _forward_equal(t)
    t.set_attention_backend("_native_math")
    assert t.attention_backend == "_native_math"
    with pytest.raises(NotImplementedError, match=r"set_attention_backend\('sage'\)"):
        t.set_attention_backend("sage")
    with pytest.raises(ValueError, match=r"set_attention_backend\('bogus'\)"):
        t.set_attention_backend("bogus")
    t.reset_attention_backend()
    assert t.attention_backend is None


def _check_exact_kernels(t):
    for on, off, name in (("enable_xformers_memory_efficient_attention", "disable_xformers_memory_efficient_attention", "xformers"),
                          ("enable_npu_flash_attention", "disable_npu_flash_attention", "_native_npu"),
                          ("enable_xla_flash_attention", "disable_xla_flash_attention", "_native_xla")):
        getattr(t, on)()
        assert t.attention_backend == name and _forward_equal(t)
        getattr(t, off)()
        assert t.attention_backend is None
    t.set_use_memory_efficient_attention_xformers(True)
    t.set_use_npu_flash_attention(True)
    t.set_use_xla_flash_attention(True)
    assert t.attention_backend == "_native_xla"
    with pytest.raises(NotImplementedError, match="partition_spec"):
        t.enable_xla_flash_attention(partition_spec=("data", None))
    t.reset_attention_backend()


def _check_fuse(t):
    assert t.fuse_qkv_projections() is None and _forward_equal(t)
    assert t.unfuse_qkv_projections() is None and _forward_equal(t)


# what each entry of METHODS marked "works" does on the golden's transformer (tmp: a directory)
def _check_cache(t):
    from diffusers.hooks import FirstBlockCacheConfig
    t.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    try:
        with t.cache_context("cond"):
            ok = t.is_cache_enabled and _forward_equal(t) and len(t.stats["cache"]) >= 1
    finally:
        t.disable_cache()
    return ok and not t.is_cache_enabled and _forward_equal(t)


def _check_lora(t):
    """An adapter loaded, weighted, fused, unfused, disabled, deleted: the output moves while it
    acts and is the golden's bit for bit after (tests/python/test_lora_dropin.py checks every
    call against diffusers + peft)."""
    from test_lora import kohya_flux
    from meshdit._lora import family_lora_state_dict

    sd, _, _ = family_lora_state_dict("flux", kohya_flux(seed=7))
    t.load_lora_adapter(sd, adapter_name="w")
    moved = not _forward_equal(t) and t.active_adapters() == ["w"]
    t.set_adapters(["w"], [0.5])
    t.set_adapter("w")
    t.fuse_lora()
    t.unfuse_lora()
    t.disable_adapters()
    t.disable_lora()
    off = _forward_equal(t)
    t.enable_adapters()
    t.enable_lora()
    on = not _forward_equal(t)
    t.delete_adapters("w")
    t.unload_lora()
    return moved and off and on and _forward_equal(t) and list(t.modules()) == [t]


WORKS = {
    "from_pretrained": lambda t, tmp: isinstance(t, meshdit.FluxTransformer),
    "save_pretrained": _check_save,
    "config": lambda t, tmp: t.config.num_attention_heads == 2 and t.config["in_channels"] == 4,
    "save_config": _check_save_config, "to_json_string": _check_save_config,
    "to_json_file": _check_save_config,
    "load_config": lambda t, tmp: type(t).load_config(FLUX) == dict(t.config),
    "forward": lambda t, tmp: _check_forward(t),
    **{n: (lambda t, tmp: _check_dtype_device(t)) for n in (
        "dtype", "device", "to", "cpu", "cuda", "xpu", "ipu", "mtia", "to_empty", "half", "float",
        "bfloat16", "double", "type")},
    "compile": lambda t, tmp: _check_compile(t),
    "compile_repeated_blocks": lambda t, tmp: _check_compile(t),
    "cache_context": lambda t, tmp: (t.cache_context("cond").__enter__(), _forward_equal(t))[1],
    "register_forward_hook": lambda t, tmp: _check_hooks(t),
    "register_forward_pre_hook": lambda t, tmp: _check_hooks(t),
    **{n: (lambda t, tmp: _check_train(t)) for n in ("eval", "train", "requires_grad_", "zero_grad")},
    "is_gradient_checkpointing": lambda t, tmp: t.is_gradient_checkpointing is False,
    "disable_gradient_checkpointing": lambda t, tmp: t.disable_gradient_checkpointing() is None,
    **{n: (lambda t, tmp: _check_tree(t)) for n in (
        "modules", "named_modules", "children", "named_children", "parameters", "named_parameters",
        "buffers", "named_buffers", "get_submodule", "get_parameter", "get_buffer", "apply",
        "share_memory", "extra_repr")},
    "num_parameters": lambda t, tmp: _check_num_parameters(t),
    "set_attention_backend": lambda t, tmp: _check_attention_backend(t),
    "reset_attention_backend": lambda t, tmp: _check_attention_backend(t),
    **{n: (lambda t, tmp: _check_exact_kernels(t)) for n in (
        "set_use_memory_efficient_attention_xformers", "enable_xformers_memory_efficient_attention",
        "disable_xformers_memory_efficient_attention", "set_use_npu_flash_attention",
        "enable_npu_flash_attention", "disable_npu_flash_attention", "set_use_xla_flash_attention",
        "enable_xla_flash_attention", "disable_xla_flash_attention")},
    "attn_processors": lambda t, tmp: t.attn_processors == {},
    "fuse_qkv_projections": lambda t, tmp: _check_fuse(t),
    "unfuse_qkv_projections": lambda t, tmp: _check_fuse(t),
    "is_cache_enabled": lambda t, tmp: t.is_cache_enabled is False,
    # a cache on, a forward in its context, off again: the golden output both times (the first
    # forward of a generation computes every block; tests/python/test_cache_pipelines.py checks
    # the skips against diffusers)
    "enable_cache": lambda t, tmp: _check_cache(t),
    "disable_cache": lambda t, tmp: _check_cache(t),
    **{n: (lambda t, tmp: _check_lora(t)) for n in (
        "load_lora_adapter", "set_adapters", "set_adapter", "active_adapters", "delete_adapters",
        "enable_adapters", "disable_adapters", "enable_lora", "disable_lora", "fuse_lora",
        "unfuse_lora", "unload_lora")},
}


@pytest.mark.parametrize("name", ["forward"] + sorted(set(WORKS) - {"forward"}))
def test_a_working_method_does_what_it_says(golden, name, tmp_path):
    if not FORWARD:
        _check_forward(golden)
    assert WORKS[name](golden, tmp_path) is not False


def test_copies_and_offload_hooks_are_refused_in_one_line(flux_root, flux_ref, mesh):
    """deepcopy and pickle failed on the connection's lock (TypeError); accelerate's offload
    hooks made every later forward stop with a bare StopIteration (model offload) or named
    state_dict (sequential). Each now says what it is, and the pipeline goes on."""
    import copy
    import pickle
    for call in (lambda: copy.deepcopy(mesh), lambda: copy.copy(mesh), lambda: pickle.dumps(mesh)):
        with pytest.raises(NotImplementedError, match="cannot be copied or pickled"):
            call()
    for enable in ("enable_model_cpu_offload", "enable_sequential_cpu_offload"):
        pipe = flux_pipeline.load(flux_root, transformer=mesh)
        with pytest.raises(NotImplementedError, match="offload hooks .* do not apply"):
            getattr(pipe, enable)(device="cpu")
        assert not hasattr(mesh, "_hf_hook")
    pipe = flux_pipeline.load(flux_root, transformer=mesh)
    assert rel(flux_pipeline.generate(pipe, **GEN), flux_ref) <= TOL


def test_attention_kwargs_that_change_nothing_pass(flux_root, flux_ref, mesh):
    """joint_attention_kwargs' LoRA scale is diffusers' (with no adapter loaded it changes
    nothing, as in diffusers; test_lora_dropin.py checks it with adapters); any other key is
    refused by name."""
    pipe = flux_pipeline.load(flux_root, transformer=mesh)
    for scale in (1.0, 0.5):
        got = flux_pipeline.generate(pipe, **GEN, joint_attention_kwargs={"scale": scale})
        assert rel(got, flux_ref) <= TOL
    x = golden_inputs()
    for bad, what in (({"ip_adapter_image_embeds": [x["hidden_states"]]}, "'ip_adapter_image_embeds'"),
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


# ---- 7. messages and documents ----------------------------------------------------------------------
def test_the_demo_says_pngs_within_one_level_agree():
    path = os.path.join(ROOT, "scripts", "diffusers-demo")
    loader = importlib.machinery.SourceFileLoader("diffusers_demo", path)
    spec = importlib.util.spec_from_loader("diffusers_demo", loader)
    demo = importlib.util.module_from_spec(spec)
    loader.exec_module(demo)
    a = np.full((4, 4, 3), 100, np.uint8)
    b = a.copy()
    assert demo.png_agreement(a, b) == "the 8-bit PNGs are identical"
    b[0, 0, 0] = 101
    assert demo.png_agreement(a, b) == "the 8-bit PNGs agree within one 8-bit level (1 of 48 values differ by 1)"
    b[1, 1, 1] = 97
    assert demo.png_agreement(a, b) == "the 8-bit PNGs differ by up to 3 levels (2 of 48 values differ)"


def test_cuda_without_the_plugin_says_make_builds_it(tmp_path):
    env = dict(os.environ, MESHDIT_CUDA_PLUGIN=str(tmp_path / "libmeshdit_cuda.so"))
    with pytest.raises(meshdit.MeshditError, match=r"no CUDA backend .*`make` builds .*when nvcc is on PATH"):
        meshdit.Transformer.from_pretrained(FLUX, device="cuda", env=env)


def _readme_example():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Use from diffusers", 1)[1].split("\n## ", 1)[0]
    return section, re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_says_what_runs_where():
    section, code = _readme_example()
    calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "meshdit.Transformer.from_pretrained"]
    assert len(calls) == 1
    kw = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords}
    assert kw.get("device") == "cuda" and kw.get("dtype") == "bf16"
    inspect.signature(meshdit.Transformer.from_pretrained).bind("DIR", **kw)  # real arguments
    assert re.search(r"dtype.*\n.*encoders.*VAE", code) and re.search(r"dtype=.*mesh", code)


def _imports(path):
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"meshdit"}


def test_pyproject_and_readme_agree_with_the_imports():
    pkg = os.path.join(ROOT, "python")
    with open(os.path.join(pkg, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    dist = {"zmq": "pyzmq", "starlette": "fastapi", "PIL": "pillow"}  # import -> distribution
    name = lambda req: re.split(r"[<>=!~ \[]", req, maxsplit=1)[0]  # noqa: E731
    required = {name(r) for r in project["dependencies"]}
    extra = {name(r) for r in project["optional-dependencies"]["diffusers"]}
    files = [os.path.join(pkg, "meshdit", f) for f in os.listdir(os.path.join(pkg, "meshdit")) if f.endswith(".py")]
    serving = [f for f in files if os.path.basename(f) in ("generate.py", "api.py")]  # the [serve] extra
    dropin_files = [os.path.join(pkg, "meshdit", f) for f in ("transformer.py", "_lora.py")]
    core = {dist.get(m, m) for f in files if f not in dropin_files and f not in serving
            for m in _imports(f)}
    dropin = {dist.get(m, m) for f in dropin_files for m in _imports(f)}
    assert required == core
    assert extra == dropin - core
    served = {dist.get(m, m) for f in serving for m in _imports(f)}
    assert served - core <= {name(r) for r in project["optional-dependencies"]["serve"]}
    with open(os.path.join(pkg, "README.md")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("pip install ")]
    said = [set(re.split(r"[,\s]+", ln.split(":", 1)[1].strip())) for ln in lines]
    assert said == [required, extra], lines


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


@pytest.mark.parametrize("layout", [{}, {"ulysses": 2}, {"tp": 2, "ring": 2}])
def test_qwen_image_layered(layout):
    """Qwen-Image-Layered (use_additional_t_cond, use_layer3d_rope), called as
    QwenImageLayeredPipeline calls it (img_shapes a list per prompt, additional_t_cond a long
    tensor), equals diffusers' transformer on one rank and on layouts; a [1] additional_t_cond
    is every element's, as diffusers broadcasts it. Controls: the other embedding row gives
    another output; the argument is required, and refused by a config without it."""
    from diffusers import QwenImageTransformer2DModel

    path = os.path.join(ROOT, "tests", "data", "qwenimage_layered")
    x = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "inputs.safetensors")).items()}
    x.pop("img_shapes")
    rgb = x.pop("additional_t_cond")
    shapes = [[(1, 2, 3)] * 3 + [(1, 3, 4)]] * 2
    theirs = QwenImageTransformer2DModel.from_pretrained(path).eval()
    with torch.no_grad():
        ref = theirs(**x, img_shapes=shapes, additional_t_cond=rgb).sample.numpy()
        one = theirs(**x, img_shapes=shapes, additional_t_cond=rgb[:1]).sample.numpy()
    assert rel(one, ref) > 100 * TOL  # the embedding row matters
    with meshdit.Transformer.from_pretrained(path, **layout) as t:
        got = t(**x, img_shapes=shapes, additional_t_cond=rgb).sample.numpy()
        assert rel(got, ref) <= TOL, layout
        got = t(**x, img_shapes=shapes, additional_t_cond=rgb[:1]).sample.numpy()
        assert rel(got, one) <= TOL, layout
        got = t(**x, img_shapes=shapes, additional_t_cond=rgb[0]).sample.numpy()  # 0-d, broadcast
        assert rel(got, one) <= TOL, layout
        if not layout:
            with pytest.raises(RuntimeError, match="'additional_t_cond' is missing"):
                t(**x, img_shapes=shapes)
    if not layout:
        with meshdit.Transformer.from_pretrained(
                os.path.join(ROOT, "tests", "data", "qwenimage_edit2511")) as t:
            with pytest.raises(ValueError, match="use_additional_t_cond false"):
                t(**x, img_shapes=shapes, additional_t_cond=rgb)


@pytest.mark.parametrize("case", ["flux_controlnet", "flux_controlnet_repeat", "qwenimage_controlnet"])
def test_controlnet_residuals(case):
    """ControlNet residuals as the pipelines pass them (lists of [B, S_img, C], XLabs' repeat flag,
    Qwen-Image's padded masks) and as a tensor [N, B, S_img, C] (diffusers indexes either) equal
    diffusers' transformer; malformed ones are refused in one line naming the argument."""
    import diffusers

    path = os.path.join(ROOT, "tests", "data", case)
    x = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "inputs.safetensors")).items()}
    for k in ("controlnet_block_samples", "controlnet_single_block_samples"):
        if k in x:
            x[k] = list(x[k].unbind(1))
    if "controlnet_blocks_repeat" in x:
        x["controlnet_blocks_repeat"] = bool(x["controlnet_blocks_repeat"].item())
    if "img_shapes" in x:
        x["img_shapes"] = [[tuple(int(v) for v in img) for img in el] for el in x["img_shapes"]]
    cls = diffusers.QwenImageTransformer2DModel if case.startswith("qwen") else diffusers.FluxTransformer2DModel
    theirs = cls.from_pretrained(path).eval()
    with torch.no_grad():
        ref = theirs(**x).sample.numpy()
        plain = theirs(**{k: v for k, v in x.items() if not k.startswith("controlnet")}).sample.numpy()
    assert rel(plain, ref) > 100 * TOL  # the residuals matter
    with meshdit.Transformer.from_pretrained(path, ulysses=2) as t:
        assert rel(t(**x).sample.numpy(), ref) <= TOL
        as_tensor = dict(x, controlnet_block_samples=torch.stack(x["controlnet_block_samples"]))
        assert rel(t(**as_tensor).sample.numpy(), ref) <= TOL
        with pytest.raises(ValueError, match="'controlnet_block_samples' must be a non-empty list"):
            t(**dict(x, controlnet_block_samples=[]))
        short = [r[:, :-1] for r in x["controlnet_block_samples"]]
        with pytest.raises(meshdit.ServerError, match="tensor 'controlnet_block_samples' has shape"):
            t(**dict(x, controlnet_block_samples=short))
        mixed = [x["controlnet_block_samples"][0], x["controlnet_block_samples"][0][:, :-1]]
        with pytest.raises(ValueError, match="every residual must be \\[B, S_img, C\\] of one shape"):
            t(**dict(x, controlnet_block_samples=mixed))
        with pytest.raises(ValueError, match=r"'controlnet_block_samples'\[1\] is NoneType"):
            t(**dict(x, controlnet_block_samples=[x["controlnet_block_samples"][0], None]))
        # element 0's residuals for the whole batch, as diffusers broadcasts [1, S_img, C]
        first = {k: [r[:1] for r in v] if k.endswith("samples") else v for k, v in x.items()}
        with torch.no_grad():
            want = theirs(**first).sample.numpy()
        assert rel(t(**first).sample.numpy(), want) <= TOL
        if x.get("controlnet_blocks_repeat"):  # read only with block residuals, as in diffusers
            bare = {k: v for k, v in x.items() if not k.startswith("controlnet")}
            assert rel(t(**bare, controlnet_blocks_repeat=True).sample.numpy(), plain) <= TOL


def test_img_shapes_zero_cond_t():
    """Qwen-Image-Edit-2511 (zero_cond_t): diffusers modulates each element's rows past its own
    first image at timestep 0. Entries whose condition images differ but whose first images have
    the same rows equal diffusers (with the warning); entries whose first images differ in rows
    are refused in one line (meshdit runs one entry for all elements; diffusers would modulate
    them differently: the control shows it)."""
    from diffusers import QwenImageTransformer2DModel

    path = os.path.join(ROOT, "tests", "data", "qwenimage_edit2511")
    x = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "inputs.safetensors")).items()}
    x.pop("img_shapes")
    a = [(1, 3, 4), (1, 2, 3), (1, 1, 2)]  # the golden's: 12 rows, then 6 + 2 condition rows
    same_first = [(1, 3, 4), (1, 1, 2), (1, 2, 3)]
    other_first = [(1, 2, 3), (1, 3, 4), (1, 1, 2)]  # 6 rows first: another split
    theirs = QwenImageTransformer2DModel.from_pretrained(path).eval()
    with torch.no_grad():
        ref = theirs(**x, img_shapes=[a, same_first]).sample.numpy()
        split = theirs(**x, img_shapes=[a, other_first]).sample.numpy()
    assert rel(split, ref) > 100 * TOL  # diffusers' per-element split matters
    with meshdit.Transformer.from_pretrained(path) as t:
        with pytest.warns(UserWarning, match="first entry"):
            got = t(**x, img_shapes=[a, same_first]).sample.numpy()
        assert rel(got, ref) <= TOL
        with pytest.raises(ValueError, match="zero_cond_t .* differ across the batch"):
            t(**x, img_shapes=[a, other_first])
