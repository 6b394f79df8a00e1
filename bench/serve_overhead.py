#!/usr/bin/env python3
"""`meshdit serve` against the in-process forward: what the server and the Python client add per
step, and the bytes a step moves with and without the constant-tensor session. Benchmarks only.

usage: OPENBLAS_NUM_THREADS=1 python bench/serve_overhead.py --checkpoint DIR --inputs FILE
           [--steps 5] [--rounds 2] [--bin build/meshdit] [--tp 1 --ring 1 --ulysses 1]
In each round, in this order: `meshdit run --steps N` (the in-process step loop; its median per
step from --report), then N forwards through `meshdit.Transformer` with sessions (the client's
wall time per forward, the server's own `step_seconds`), then N without sessions (bytes only).
The forwards vary hidden_states and timestep per step, as a denoising loop does. The table gives
medians over all rounds and the overhead as a fraction of the in-process step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import meshdit  # noqa: E402
from sgemm_rate import cpu_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bin", default="build/meshdit")
    for k in ("tp", "ring", "ulysses"):
        ap.add_argument(f"--{k}", type=int, default=1)
    a = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ.pop("OPENBLAS_CORETYPE", None)
    layout = {"tp": a.tp, "ring": a.ring, "ulysses": a.ulysses}
    world = a.tp * a.ring * a.ulysses
    base = load_file(a.inputs)
    steps = [dict(base, hidden_states=base["hidden_states"] * (1 - 0.1 * i),
                  timestep=base["timestep"] * (1 - 0.1 * i)) for i in range(a.steps)]
    inproc, server, client, sent_s, sent_n = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            rep = os.path.join(tmp, "r.json")
            cmd = ["mpiexec.mpich", "-n", str(world), a.bin, "run", "--checkpoint", a.checkpoint,
                   "--inputs", a.inputs, "--out", os.path.join(tmp, "o.safetensors"),
                   "--steps", str(a.steps), "--report", rep, "--quiet"]
            cmd += [x for k, v in layout.items() for x in (f"--{k}", str(v))]
            subprocess.run(cmd, check=True)
            inproc.append(json.load(open(rep))["step_seconds_median"])
            with meshdit.Transformer.from_pretrained(a.checkpoint, binary=a.bin, **layout) as t:
                for s in steps:
                    t(**s)
                client += t.stats["wall_seconds"]
                server += t.stats["step_seconds"]
                sent_s += t.stats["request_bytes"]
                with meshdit.Transformer.connect(t._client.endpoint, sessions=False) as plain:
                    for s in steps[:2]:
                        plain(**s)
                    sent_n += plain.stats["request_bytes"]
    med = statistics.median
    m_in, m_srv, m_cli = med(inproc), med(server), med(client)
    later = sent_s[1:a.steps]  # steps after a session's first
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; layout {layout}; "
          f"{a.steps} steps x {a.rounds} rounds; torch {torch.__version__}\n")
    print("| what | median |\n|---|---|")
    print(f"| in-process step (`meshdit run --steps {a.steps}`) | {m_in:.4f} s |")
    print(f"| server's own step (`step_seconds`) | {m_srv:.4f} s |")
    print(f"| client wall per forward (`meshdit.Transformer`) | {m_cli:.4f} s |")
    print(f"| overhead: client wall - in-process step | {m_cli - m_in:+.4f} s "
          f"({100 * (m_cli - m_in) / m_in:+.2f}% of the step) |")
    print(f"| of which transport + codec: client wall - server step | {m_cli - m_srv:+.4f} s "
          f"({100 * (m_cli - m_srv) / m_in:+.2f}%) |")
    print(f"| bytes per step, no session | {med(sent_n):,.0f} |")
    print(f"| bytes per step, session: first / later | {sent_s[0]:,} / {med(later):,.0f} |")


if __name__ == "__main__":
    main()
