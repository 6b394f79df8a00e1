"""Real diffusers pipelines end to end: the same pipeline, weights and seed, once with diffusers'
own transformer and once with `meshdit.Transformer` on several layouts; the decoded outputs
agree within 1e-4 relative (f32). The pipelines are built locally from small random components
(tests/python/*_pipeline.py): nothing is downloaded."""
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


# ---- MiniMax-H3: diffusers 0.42.1's modular pipeline, text to video + audio ----------------
@pytest.fixture(scope="module")
def h3_root(tmp_path_factory):
    import h3_pipeline
    root = str(tmp_path_factory.mktemp("h3_pipe"))
    h3_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def h3_ref(h3_root):
    import h3_pipeline
    pipe = h3_pipeline.load(h3_root)
    return h3_pipeline.generate(pipe, seed=5, steps=2), h3_pipeline.generate(pipe, seed=6, steps=2)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_h3_pipeline(h3_root, h3_ref, layout):
    import h3_pipeline
    ref, other = h3_ref
    with meshdit.Transformer.from_pretrained(f"{h3_root}/transformer", **layout) as t:
        assert isinstance(t, meshdit.MiniMaxH3Transformer)
        pipe = h3_pipeline.load(h3_root, transformer=t)
        got = h3_pipeline.generate(pipe, seed=5, steps=2)
        assert t.stats["forwards"] == 2
    assert set(got) == set(ref) == {"video", "audio"}
    for k in ref:
        assert got[k].shape == ref[k].shape
        print(f"h3 {layout} {k}: max rel diff {rel(got[k], ref[k]):.2e}")
        assert rel(got[k], ref[k]) <= TOL
        assert rel(other[k], ref[k]) > 100 * TOL  # the comparison can fail


# ---- Qwen-Image: QwenImagePipeline, a batch of two prompts with true CFG and padded masks ----
@pytest.fixture(scope="module")
def qwen_root(tmp_path_factory):
    import qwenimage_pipeline
    root = str(tmp_path_factory.mktemp("qwen_pipe"))
    qwenimage_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def qwen_ref(qwen_root):
    import qwenimage_pipeline
    pipe = qwenimage_pipeline.load(qwen_root)
    return (qwenimage_pipeline.generate(pipe, seed=7, steps=2),
            qwenimage_pipeline.generate(pipe, seed=8, steps=2))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_qwenimage_pipeline(qwen_root, qwen_ref, layout):
    import qwenimage_pipeline
    ref, other = qwen_ref
    with meshdit.Transformer.from_pretrained(f"{qwen_root}/transformer", **layout) as t:
        assert isinstance(t, meshdit.QwenImageTransformer)
        pipe = qwenimage_pipeline.load(qwen_root, transformer=t)
        got = qwenimage_pipeline.generate(pipe, seed=7, steps=2)
        assert t.stats["forwards"] == 4  # 2 steps x (prompt, negative prompt)
    assert got.shape == ref.shape and got.shape[0] == 2
    print(f"qwenimage {layout}: max rel diff {rel(got, ref):.2e}")
    assert rel(got, ref) <= TOL
    assert rel(other, ref) > 100 * TOL  # the comparison can fail


# ---- Wan 2.1: WanPipeline, text to video with classifier-free guidance ---------------------
@pytest.fixture(scope="module")
def wan_root(tmp_path_factory):
    import wan_pipeline
    root = str(tmp_path_factory.mktemp("wan_pipe"))
    wan_pipeline.build(root, seed=0)
    return root


@pytest.fixture(scope="module")
def wan_ref(wan_root):
    import wan_pipeline
    pipe = wan_pipeline.load(wan_root)
    return wan_pipeline.generate(pipe, seed=9, steps=2), wan_pipeline.generate(pipe, seed=10, steps=2)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()) or "1rank")
def test_wan_pipeline(wan_root, wan_ref, layout):
    import wan_pipeline
    ref, other = wan_ref
    with meshdit.Transformer.from_pretrained(f"{wan_root}/transformer", **layout) as t:
        assert isinstance(t, meshdit.WanTransformer)
        pipe = wan_pipeline.load(wan_root, transformer=t)
        got = wan_pipeline.generate(pipe, seed=9, steps=2)
        assert t.stats["forwards"] == 4  # 2 steps x (prompt, negative prompt)
    assert got.shape == ref.shape and got.ndim == 4
    print(f"wan {layout}: max rel diff {rel(got, ref):.2e}")
    assert rel(got, ref) <= TOL
    assert rel(other, ref) > 100 * TOL  # the comparison can fail
