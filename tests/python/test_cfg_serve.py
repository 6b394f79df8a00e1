"""`cfg=2` under unmodified diffusers pipelines: both branches of each guided step at once.

diffusers' pipelines call the transformer for the conditional branch, then for the
unconditional one on the same latents and timestep. A drop-in with cfg=2 names, with each
conditional forward, the session of its other branch (learnt from the previous step); the
server's second cfg group computes that forward while the first computes the request, and the
unconditional request that follows is answered from it when its inputs are the same bytes.

Checked: every family whose pipeline guides (Wan, Qwen-Image, Flux.2 [klein], FLUX.1 with
true_cfg_scale) against diffusers' own pipeline within 1e-4, with cfg_hits = steps - 1 (the first
step has no pair yet), on cfg=2 and cfg=2 x tp=2 (and x ulysses=2 for one); a client whose
unconditional latents differ from the conditional ones gets its own forward's answer (negative
control); cfg_next on a one-group server is refused; a concurrent forward whose inputs fail at
once waits for the busy group instead of ending the job.
"""
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import flux2_pipeline
import flux_pipeline
import meshdit
import qwenimage_pipeline
import wan_pipeline
from meshdit.client import ServerError

TOL = 1e-4
STEPS = 4
DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


FAMILIES = {
    "wan": (wan_pipeline, {}),
    "qwenimage": (qwenimage_pipeline, {}),
    "flux2": (flux2_pipeline, {}),
    "flux": (flux_pipeline, dict(true_cfg_scale=2.0, negative_prompt="a blue ball")),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    out = {}
    for name, (mod, _) in FAMILIES.items():
        root = str(tmp_path_factory.mktemp(f"cfg_{name}"))
        mod.build(root, seed=0)
        out[name] = root
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", [dict(cfg=2), dict(cfg=2, tp=2)], ids=["cfg2", "cfg2xtp2"])
def test_a_guided_pipeline_runs_both_branches_at_once(roots, family, layout):
    mod, kw = FAMILIES[family]
    root = roots[family]
    want = mod.generate(mod.load(root), steps=STEPS, **kw)
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        got = mod.generate(mod.load(root, transformer=t), steps=STEPS, **kw)
        hits, misses, n = t.stats["cfg_hits"], t.stats["cfg_misses"], t.stats["forwards"]
    print(f"{family} {layout}: {rel(got, want):.2e}, {hits} hits, {misses} misses, {n} forwards")
    assert rel(got, want) <= TOL
    assert n == 2 * STEPS and hits == STEPS - 1 and misses == 1


def test_cfg2_x_ulysses2_equals_one_rank(roots):
    mod, kw = FAMILIES["wan"]
    root = roots["wan"]
    with meshdit.Transformer.from_pretrained(f"{root}/transformer") as t:
        one = mod.generate(mod.load(root, transformer=t), steps=STEPS, **kw)
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", cfg=2, ulysses=2) as t:
        four = mod.generate(mod.load(root, transformer=t), steps=STEPS, **kw)
        assert t.stats["cfg_hits"] == STEPS - 1
    assert rel(four, one) <= 1e-5


def test_other_latents_get_their_own_forward():
    """Negative control: after two guided steps have paired the branches, an unconditional call
    whose latents differ from the conditional call's is computed for its own inputs (never the
    concurrent forward's answer), equal to diffusers' transformer on them."""
    from diffusers import FluxTransformer2DModel

    case = f"{DATA}/flux_tiny"
    x = load_file(f"{case}/inputs.safetensors")
    neg = dict(x, encoder_hidden_states=x["encoder_hidden_states"].flip(1),
               pooled_projections=-x["pooled_projections"])
    ref = FluxTransformer2DModel.from_pretrained(case).eval()
    with meshdit.Transformer.from_pretrained(case, cfg=2) as t, torch.no_grad():
        for step in range(3):
            hs = x["hidden_states"] * (1 + step)
            for inp in (dict(x, hidden_states=hs), dict(neg, hidden_states=hs)):
                got = t(**inp, return_dict=False)[0].numpy()
                assert rel(got, ref(**inp, return_dict=False)[0].numpy()) <= TOL
        assert t.stats["cfg_hits"] == 2
        hs = x["hidden_states"] * 4
        t(**dict(x, hidden_states=hs))  # the server computes the other branch on hs ...
        other = dict(neg, hidden_states=hs + 0.5)  # ... but this one asks for other latents
        got = t(**other, return_dict=False)[0].numpy()
        assert rel(got, ref(**other, return_dict=False)[0].numpy()) <= TOL
        assert t.stats["cfg_hits"] == 2  # not answered from the concurrent forward
        assert t.stats["forwards"] == 8
        assert t.stats["cfg_misses"] == 2  # the first step's, and this one
        # the pair itself was right (other latents, same sessions): the next steps hit again
        for step in (5, 6):
            hs = x["hidden_states"] * step
            for inp in (dict(x, hidden_states=hs), dict(neg, hidden_states=hs)):
                got = t(**inp, return_dict=False)[0].numpy()
                assert rel(got, ref(**inp, return_dict=False)[0].numpy()) <= TOL
        assert t.stats["cfg_hits"] == 4 and t.stats["cfg_misses"] == 2


def test_cfg_next_needs_two_groups():
    from meshdit import _blob

    case = f"{DATA}/flux_tiny"
    with meshdit.Transformer.from_pretrained(case) as t:
        assert t.info["cfg"] == "1"
        x = {k: _blob.raw(v.numpy()) for k, v in load_file(f"{case}/inputs.safetensors").items()}
        with pytest.raises(ServerError, match="needs a server started with --cfg 2"):
            t._client.forward(x, cfg_next="0" * 32)


def test_an_other_branch_that_fails_at_once_does_not_end_the_server(monkeypatch):
    """A client names as cfg_next a session whose kept img_ids (8 positions) do not fit the
    request's 16 image tokens: group 1's forward fails at its input check while group 0's runs.
    With a failure-agreement wait shorter than any forward (MESHDIT_AGREE_TIMEOUT=0.001), the
    failed group still waits for the busy one: the request is answered (run again alone) and the
    server lives. Control: the same server answers a well-formed pair with a hit after it."""
    from diffusers import FluxTransformer2DModel
    from meshdit import _blob

    monkeypatch.setenv("MESHDIT_AGREE_TIMEOUT", "0.001")  # the server inherits it
    case = f"{DATA}/flux_tiny"
    x = load_file(f"{case}/inputs.safetensors")
    raw = {k: _blob.raw(v.numpy()) for k, v in x.items()}
    ref = FluxTransformer2DModel.from_pretrained(case).eval()
    with meshdit.Transformer.from_pretrained(case, cfg=2) as t, torch.no_grad():
        c = t._client
        half = dict(raw, hidden_states=_blob.raw(x["hidden_states"][:, :8].numpy()),
                    img_ids=_blob.raw(x["img_ids"][:8].numpy()))
        c.forward(half, session="bad", keep=["img_ids"])  # valid: 8 tokens, 8 positions
        c.forward(raw, session="good", keep=["encoder_hidden_states"])
        meta, out = c.forward(raw, cfg_next=c._tokens["bad"])  # 16 tokens + bad's 8 positions
        want = ref(**x, return_dict=False)[0].numpy()
        assert rel(out["sample"], want) <= TOL
        assert meta.get("cfg_speculated") != "1"  # the other branch failed: nothing kept
        meta, out = c.forward(raw, cfg_next=c._tokens["good"])  # the control: a pair that fits
        assert meta.get("cfg_speculated") == "1"
        meta, out2 = c.forward({k: v for k, v in raw.items() if k != "encoder_hidden_states"},
                               session="good")
        assert meta["cfg"] == "hit" and rel(out2["sample"], want) <= TOL


@pytest.mark.parametrize("layout", [dict(cfg=2), dict(cfg=2, tp=2)], ids=["cfg2", "cfg2xtp2"])
def test_a_batch_is_split_between_the_groups(roots, layout):
    """Without a second branch, a batch of several images (num_images_per_prompt=3: rows 0-1
    on group 0, row 2 on group 1) is cut between the two groups and joined: the images equal
    diffusers' pipeline's, and the replies say "split"."""
    root = roots["flux"]
    kw = dict(steps=2, num_images_per_prompt=3)
    want = flux_pipeline.generate(flux_pipeline.load(root), **kw)
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", **layout) as t:
        seen = []
        orig = t._client.forward

        def spy(*a, **k):
            meta, out = orig(*a, **k)
            seen.append(meta.get("cfg"))
            return meta, out
        t._client.forward = spy
        got = flux_pipeline.generate(flux_pipeline.load(root, transformer=t), **kw)
    assert rel(got, want) <= TOL
    assert seen == ["split"] * 2, seen


def test_a_split_batch_equals_one_group(roots):
    """The same batch of 3 on one rank and split over cfg=2: within 1e-5 (each group's GEMMs see
    fewer rows), and a batch of 1 is not split."""
    case = f"{DATA}/flux_tiny"
    x = load_file(f"{case}/inputs.safetensors")
    g = torch.Generator().manual_seed(1)
    xb = {k: torch.cat([v] + [v + 0.1 * torch.randn(v.shape, generator=g) for _ in range(2)])
          if k in ("hidden_states", "encoder_hidden_states", "pooled_projections") else v
          for k, v in x.items()}
    with meshdit.Transformer.from_pretrained(case) as t, torch.no_grad():
        one = t(**xb).sample.numpy()
    with meshdit.Transformer.from_pretrained(case, cfg=2) as t, torch.no_grad():
        two = t(**xb).sample.numpy()
        single = t(**x).sample.numpy()
    assert two.shape == one.shape and rel(two, one) <= 1e-5
    assert rel(single, one[:1]) <= 1e-5
