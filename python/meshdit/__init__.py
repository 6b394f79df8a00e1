"""meshdit: run a diffusion transformer on an MPI mesh (`meshdit serve`) from Python.

- `Client`, `Server`: the protocol of docs/serve.md with numpy, pyzmq and safetensors blobs.
- `Transformer` (needs torch and diffusers): a drop-in for a diffusers transformer in a pipeline,
  ``meshdit.Transformer.from_pretrained(DIR, tp=2, ulysses=2)``.
"""
from .client import Client, MeshditError, ServerError
from .server import Server

_DROP_INS = ("Transformer", "FluxTransformer", "MiniMaxH3Transformer", "Flux2Transformer",
             "QwenImageTransformer", "WanTransformer")
__all__ = ["Client", "Server", "MeshditError", "ServerError", *_DROP_INS]
__version__ = "0.1.0"


def __getattr__(name):  # the torch layer is imported on first use only
    if name in _DROP_INS:
        from . import transformer
        return getattr(transformer, name)
    raise AttributeError(f"module 'meshdit' has no attribute {name!r}")
