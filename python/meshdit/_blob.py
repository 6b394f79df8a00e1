"""Safetensors blobs: the message body of `meshdit serve` (docs/serve.md, "Messages").

A blob is the bytes of a .safetensors file held in memory: an 8-byte little-endian header
length, a JSON header (``__metadata__`` with string values, then one entry per tensor), and the
data section. This module writes and reads them with numpy alone, so a request can carry bf16 or
f16 data as it is (numpy has no bfloat16; the torch layer hands raw bytes) and nothing is copied
twice. The server reads a request with the same validating reader as a checkpoint file.
"""
from __future__ import annotations

import json
import struct
from typing import Iterable, Mapping, NamedTuple

import numpy as np

# safetensors dtype name -> numpy dtype (little-endian); BF16 has no numpy dtype
_NP = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U8": "u1", "BOOL": "?",
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1}
_FROM_NP = {np.dtype(v).str: k for k, v in _NP.items()}


class Raw(NamedTuple):
    """A tensor as bytes: safetensors dtype name, shape, the row-major little-endian data."""
    dtype: str
    shape: tuple
    data: memoryview


def raw(array) -> Raw:
    """A numpy array as a Raw tensor (made contiguous and little-endian; no copy when it is)."""
    a = np.asarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    key = a.dtype.str
    if key not in _FROM_NP:
        raise TypeError(f"meshdit: a tensor of numpy dtype {a.dtype} cannot be sent "
                        f"(supported: {', '.join(sorted(_NP))}, and BF16 as raw bytes)")
    return Raw(_FROM_NP[key], tuple(int(d) for d in a.shape), memoryview(a.reshape(-1).view(np.uint8)))


def encode(metadata: Mapping[str, str], tensors: Mapping[str, Raw] | None = None) -> list:
    """The blob of a request, as a list of buffers to send as one ZeroMQ frame's parts.

    Returns [header bytes, data 0, data 1, ...]; join them (b"".join) for one frame. Tensors are
    laid out in the given order, each at the end of the previous one.
    """
    tensors = dict(tensors or {})
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    parts, off = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"meshdit: {name!r} cannot name a tensor")
        if not isinstance(t, Raw):
            t = raw(t)  # a numpy array (or anything np.asarray takes)
        data = t.data if isinstance(t.data, memoryview) else memoryview(t.data)
        t = t._replace(data=data.cast("B") if data.format != "B" or data.ndim != 1 else data)
        if any(not isinstance(d, int) or d < 0 for d in t.shape):
            raise ValueError(f"meshdit: tensor '{name}': shape {list(t.shape)}")
        n = len(t.data)
        count = 1
        for d in t.shape:
            count *= d
        if t.dtype not in _ITEMSIZE or n != count * _ITEMSIZE[t.dtype]:
            raise ValueError(f"meshdit: tensor '{name}': {n} bytes for dtype {t.dtype} "
                             f"shape {list(t.shape)}")
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + n]}
        parts.append(t.data)
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return [struct.pack("<Q", len(h)) + h] + parts


def decode(blob) -> tuple[dict, dict]:
    """(metadata, {name: numpy array}) of a reply blob; arrays are read-only views of the blob.

    Raises ValueError on a blob that is not a well-formed safetensors blob (the server sent
    something else, or the message was cut).
    """
    buf = memoryview(blob)
    if len(buf) < 8:
        raise ValueError(f"meshdit: a reply of {len(buf)} bytes is not a safetensors blob")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > len(buf) - 8:
        raise ValueError(f"meshdit: a reply's header length {n} exceeds its {len(buf)} bytes")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except ValueError as e:
        raise ValueError(f"meshdit: a reply's header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("meshdit: a reply's header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data = buf[8 + n:]
    out = {}
    if not isinstance(meta, dict):
        raise ValueError("meshdit: a reply's __metadata__ is not a JSON object")
    for name, e in header.items():
        try:
            dt, shape, (b, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
            ok = dt in _NP and 0 <= b <= end <= len(data) and all(d >= 0 for d in shape)
            a = np.frombuffer(data[b:end], dtype=_NP[dt]).reshape(shape) if ok else None
        except (KeyError, TypeError, ValueError):
            a = None
        if a is None:
            raise ValueError(f"meshdit: a reply's tensor '{name}' is not a valid entry "
                             f"(dtype, shape and offsets within its {len(data)} data bytes)")
        out[name] = a
    return meta, out


def names(tensors: Iterable[str]) -> str:
    """A comma-separated name list for a `keep` key."""
    return ",".join(tensors)
