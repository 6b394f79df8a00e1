"""Reads (B, S_img, S_txt) from a Flux inputs.safetensors header without third-party packages."""
import json
import struct


def shapes(path):
    with open(path, "rb") as fp:
        n = struct.unpack("<Q", fp.read(8))[0]
        h = json.loads(fp.read(n))
    hs, ehs = h["hidden_states"]["shape"], h["encoder_hidden_states"]["shape"]
    return hs[0], hs[1], ehs[1]
