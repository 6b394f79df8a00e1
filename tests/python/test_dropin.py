"""The drop-in as a diffusers user drives it (issue 27): torch.compile. One tiny FluxPipeline
(tests/python/flux_pipeline.py) and the tiny Flux golden (tests/data/flux_tiny) on one rank."""
import os

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
