"""What the tiny-pipeline builders (tests/python/*_pipeline.py) share: local tokenizer vocabularies,
perturbing constant parameters, and the tools of their __main__ checks (a non-Module stand-in for the
transformer, capturing its calls, saving a call's inputs for `meshdit run`, relative error)."""
import contextlib

import torch


def bytes_to_unicode():
    """GPT-2 / CLIP / Qwen2 byte -> printable unicode character table (byte-level BPE symbols)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def bpe_vocab(words, specials):
    """A byte-level BPE over the 256 byte symbols with one left-to-right merge chain per word (so each word
    is one token), then the special tokens: (vocab, merges)."""
    b2u = bytes_to_unicode()
    vocab = {}
    for b in range(256):
        vocab.setdefault(b2u[b], len(vocab))
    merges = []
    for w in words:
        syms = [b2u[b] for b in w.encode("utf-8")]
        while len(syms) > 1:
            if (syms[0], syms[1]) not in merges:
                merges.append((syms[0], syms[1]))
            syms = [syms[0] + syms[1]] + syms[2:]
            vocab.setdefault(syms[0], len(vocab))
    for token in specials:
        vocab[token] = len(vocab)
    return vocab, merges


def t5_tokenizer(words):
    """A UMT5/T5-style tokenizer (sentencepiece Unigram, ``T5TokenizerFast``) over a small local vocabulary:
    <pad>=0, </s>=1, <unk>=2, then the word-start mark, single characters and one piece per word."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    seen = {p for p, _ in pieces}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-":
        for p, s in ((c, -6.0), ("\u2581" + c, -5.0)):
            if p not in seen:
                seen.add(p)
                pieces.append((p, s))
    for w in words:
        p = "\u2581" + w
        if p not in seen:
            seen.add(p)
            pieces.append((p, -1.0 - 0.01 * len(pieces)))
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def perturb_constants(model, gen, scale=0.1):
    """Every parameter that is one constant (norm weights at 1, zero biases, zero-initialised projections,
    gates, scales) gets noise, so that a wrong use of it shows in the output."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


class ForwardProxy:
    """A plain object (not a torch.nn.Module) in front of a transformer, with only what a pipeline uses:
    .config, .dtype, .device, cache_context(name), forward (diffusers' signature) and __call__: what a
    meshdit drop-in looks like to the pipeline. Any other attribute asked for is recorded in `probes`
    (and is missing)."""

    def __init__(self, model):
        self._model = model
        self.config = model.config
        self.dtype = model.dtype
        self.device = model.device
        self.forward = model.forward  # bound method: inspect.signature gives the diffusers parameters
        self.probes = []

    @contextlib.contextmanager
    def cache_context(self, name, **kwargs):
        yield

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name):  # only reached for attributes not set above
        if not name.startswith("__"):
            self.__dict__.setdefault("probes", []).append(name)
        raise AttributeError(name)


def capture_calls(model):
    """Forward hook keeping the kwargs and outputs (`sample`, and `audio_sample` where the model has one) of
    every call of the model, in call order: (calls, hook handle)."""
    calls = []

    def hook(module, args, kwargs, output):
        if isinstance(output, tuple):
            outs = output
        else:
            outs = tuple(getattr(output, n) for n in ("sample", "audio_sample") if getattr(output, n, None) is not None)
        rec = {"kwargs": {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}}
        for name, t in zip(("sample", "audio_sample"), outs):
            rec[name] = t.detach().clone()
        calls.append(rec)

    return calls, model.register_forward_hook(hook, with_kwargs=True)


def save_inputs(kwargs, path):
    """A transformer call's kwargs as meshdit inputs in a safetensors file: float tensors as float32,
    integer/bool tensors as int64, img_shapes (per batch element a list of (frames, height, width)) as int64
    [B, n, 3]; None, an empty attention_kwargs and return_dict are not saved. Returns (tensors, notes)."""
    from safetensors.torch import save_file

    tensors, notes = {}, []
    for name, value in kwargs.items():
        if name == "img_shapes" and value is not None:
            tensors[name] = torch.tensor([[list(s) for s in elem] for elem in value], dtype=torch.int64)
            notes.append(f"img_shapes={value!r} -> int64 {list(tensors[name].shape)}")
            continue
        if not torch.is_tensor(value):
            if value is not None and name != "return_dict" and value != {}:
                notes.append(f"{name}={value!r} (not a tensor, not saved)")
            continue
        if value.is_floating_point():
            if value.dtype != torch.float32:
                notes.append(f"{name}: {value.dtype} -> float32")
            value = value.to(torch.float32)
        else:
            if value.dtype != torch.int64:
                notes.append(f"{name}: {value.dtype} -> int64")
            value = value.to(torch.int64)
        tensors[name] = value.contiguous()
    save_file(tensors, path)
    return tensors, notes


def rel(a, b):
    """max |a - b| / max |b| of two torch tensors."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def replay(meshdit, checkpoint, call, inp, outp, label, outputs=("sample",)):
    """One captured transformer call (capture_calls) replayed in `meshdit run` on `checkpoint`: its inputs
    saved to `inp` (save_inputs, notes printed), the run's outputs in `outp` compared with diffusers' for
    each name in `outputs` (max |a - b| / max |b| < 1e-4). Prints what it did; returns whether it agreed."""
    import subprocess
    import time

    from safetensors.torch import load_file

    tensors, notes = save_inputs(call["kwargs"], inp)
    print(f"{label} inputs: " + ", ".join(f"{k} {list(v.shape)} {str(v.dtype)[6:]}" for k, v in tensors.items()))
    for n in notes:
        print(f"  note: {n}")
    cmd = [meshdit, "run", "--checkpoint", checkpoint, "--inputs", inp, "--out", outp, "--quiet"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(f"  $ meshdit {' '.join(cmd[1:])}: rc {r.returncode} ({time.perf_counter() - t0:.2f}s)")
    if r.returncode:
        print("meshdit refused the pipeline's inputs:\n" + r.stdout + r.stderr)
        return False
    out, ok = load_file(outp), True
    for name in outputs:
        ref, got = call[name], out.get(name)
        if got is None or tuple(got.shape) != tuple(ref.shape):
            print(f"  {name}: meshdit {None if got is None else list(got.shape)} vs diffusers {list(ref.shape)}")
            ok = False
            continue
        e = rel(got, ref)
        print(f"  meshdit vs diffusers {name} {list(ref.shape)}: max|a-b| {float((got - ref).abs().max()):.3e}, "
              f"max|b| {float(ref.abs().max()):.3e}, rel {e:.3e}")
        ok &= e < 1e-4
    return ok


def load_pipeline(cls, root, transformer=None, default_transformer=None):
    """cls.from_pretrained(root) on CPU in float32, with `transformer` instead of root/transformer if given.
    diffusers accepts from_pretrained(transformer=obj) only for a ModelMixin (model_index.json names the
    diffusers class; pipeline_loading_utils.maybe_raise_or_warn refuses anything else), so any other object
    (a meshdit drop-in) is attached with register_modules after loading with transformer=None, and
    root/transformer is then not read. `default_transformer` (a callable) builds the model used when no
    transformer is given (a family whose from_pretrained needs accelerate)."""
    from diffusers.models.modeling_utils import ModelMixin

    kwargs = {"dtype": torch.float32}
    if transformer is None and default_transformer is not None:
        transformer = default_transformer()
    if transformer is None:
        pipe = cls.from_pretrained(root, **kwargs)
    elif isinstance(transformer, ModelMixin):
        pipe = cls.from_pretrained(root, transformer=transformer, **kwargs)
    else:
        pipe = cls.from_pretrained(root, transformer=None, **kwargs)
        pipe.register_modules(transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
