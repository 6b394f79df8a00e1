#!/usr/bin/env python3
"""`meshdit api` against a direct pipeline call: the service's overhead per image, the time to
recover from a lost rank, and throughput with a queue of requests. Benchmarks only.

usage: python bench/api_overhead.py [--size 256] [--steps 4] [--rounds 3] [--tp 1] [--queue 6]
           [--bin build/meshdit]

The pipeline is tests/python/flux_pipeline.py's with a medium-sized transformer (as
bench/pipeline_wall.py: the medium preset's blocks and heads), so the transformer dominates as
in a real pipeline. Both sides run the same pipeline folder, layout, prompt and seeds, with one
torch thread in the pipeline's process and one thread per rank (OMP_NUM_THREADS=1 for both: oneDNN
in the ranks reads it too):

- direct: this process, `meshdit.Transformer.from_pretrained(...)` + `FluxPipeline`, and a PNG
  encoded from the image (what a script that writes files does);
- service: `python -m meshdit api` on the same folder and layout, requests from the official
  `openai` client (b64_json, decoded back to PNG bytes).

They alternate `--rounds` times; the medians and their difference are the overhead. Then a rank
is killed (SIGKILL) at step 2 of a streamed request: the request's wall time against an
undisturbed one is what the loss cost, and the job's own record splits it (detect, relaunch,
redo). Then `--queue` requests at once: their total wall time against as many direct calls.
"""
import argparse
import base64
import concurrent.futures
import io
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "tests", "python")]
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"  # torch here and in the service, oneDNN in every rank: alike
os.environ.pop("OPENBLAS_CORETYPE", None)

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

import flux_pipeline  # noqa: E402
import meshdit  # noqa: E402
from service_util import Api, kill_rank, png_pixels  # noqa: E402

MEDIUM = dict(num_layers=2, num_single_layers=4, attention_head_dim=128, num_attention_heads=8,
              axes_dims_rope=(16, 56, 56))
PROMPT = "a red cube on a table"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--queue", type=int, default=6)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "meshdit"))
    a = ap.parse_args()
    os.environ["MESHDIT_BIN"] = os.path.abspath(a.bin)
    torch.set_num_threads(1)
    size, steps = a.size, a.steps
    body = {"prompt": PROMPT, "size": f"{size}x{size}", "steps": steps,
            "max_sequence_length": flux_pipeline.TXT_LEN}
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "flux_medium")
        flux_pipeline.build(root, seed=0, transformer_config=MEDIUM)
        api = Api(root, "--tp", str(a.tp), "--max-queue", str(a.queue + 2),
                  "--max-pixels", str(size * size))
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0,
                               timeout=3600)
        try:
            with meshdit.Transformer.from_pretrained(os.path.join(root, "transformer"), tp=a.tp) as t:
                pipe = flux_pipeline.load(root, transformer=t)

                def direct(seed):
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        img = pipe(prompt=PROMPT, height=size, width=size, num_inference_steps=steps,
                                   max_sequence_length=flux_pipeline.TXT_LEN, output_type="pil",
                                   generator=torch.Generator("cpu").manual_seed(seed)).images[0]
                    t1 = time.perf_counter()
                    buf = io.BytesIO()
                    img.save(buf, format="PNG")
                    return time.perf_counter() - t0, buf.getvalue(), t1 - t0

                def served(seed):
                    t0 = time.perf_counter()
                    r = client.images.generate(**{k: body[k] for k in ("prompt", "size")},
                                               response_format="b64_json",
                                               extra_body={"seed": seed, "steps": steps,
                                                           "max_sequence_length": flux_pipeline.TXT_LEN})
                    data = base64.b64decode(r.data[0].b64_json)
                    return time.perf_counter() - t0, data, r.model_extra["meshdit"]

                direct(0), served(0)  # warm-up: first-call costs on both sides
                td, ts, tdp, tsp, pair = [], [], [], [], []
                for k in range(a.rounds):
                    if k % 2:  # the order alternates too: a drift of the machine cancels
                        s, simg, md = served(10 + k)
                        d, dimg, dp = direct(10 + k)
                    else:
                        d, dimg, dp = direct(10 + k)
                        s, simg, md = served(10 + k)
                    td.append(d)
                    ts.append(s)
                    tdp.append(dp)
                    tsp.append(md["pipeline_seconds"])
                    pair.append(s - d)
                    same = int(np.max(np.abs(png_pixels(dimg).astype(int) - png_pixels(simg))))
                seq = [direct(100 + k)[0] for k in range(a.queue)]
            med = statistics.median
            md_, ms_ = med(td), med(ts)
            around_d = med(x - y for x, y in zip(td, tdp))  # the PNG
            around_s = med(x - y for x, y in zip(ts, tsp))  # HTTP, queue, PNG, base64, JSON
            print(f"FluxPipeline {size}x{size}, {steps} steps, medium transformer, tp={a.tp}; "
                  f"{a.rounds} rounds alternating; torch {torch.__version__}, 1 thread\n")
            print("| per image (median) | direct | service |\n|---|---|---|")
            print(f"| wall: pipeline call + PNG / openai request, b64 PNG back | {md_:.3f} s | {ms_:.3f} s |")
            print(f"| the pipeline call alone | {med(tdp):.3f} s | {med(tsp):.3f} s |")
            print(f"| around the pipeline call | {around_d * 1e3:.1f} ms | {around_s * 1e3:.1f} ms |")
            print(f"\n**what the service adds around the pipeline call: {(around_s - around_d) * 1e3:+.1f} ms "
                  f"({(around_s - around_d) / md_:+.2%} of an image)**; wall against wall, paired by "
                  f"round: median {med(pair) * 1e3:+.1f} ms ({med(pair) / md_:+.2%}), range "
                  f"{min(pair) * 1e3:+.0f} to {max(pair) * 1e3:+.0f} ms")
            print(f"\nlast round's images differ by {same} 8-bit levels")

            # a lost rank: kill rank 1 at step 2 of a streamed request
            base = statistics.median(served(200)[0] for _ in range(2))
            t0 = time.perf_counter()
            rec, killed = None, False
            with httpx.stream("POST", f"{api.url}/v1/images/generations", timeout=3600,
                              json={**body, "seed": 201, "stream": True}) as r:
                name = None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        ev = json.loads(line[6:])
                        if name == "image_generation.progress" and ev["step"] == 2 and not killed:
                            kill_rank(f"{root}/transformer", 1 if a.tp > 1 else 0)
                            killed = True
                        elif name == "image_generation.resumed":
                            rec = ev
            lost = time.perf_counter() - t0
            print(f"\n| a rank killed at step 2 of {steps} | |\n|---|---|")
            print(f"| undisturbed request (median of 2) | {base:.3f} s |")
            print(f"| request with the loss | {lost:.3f} s |")
            print(f"| **cost of the loss** | **{lost - base:.3f} s** |")
            if rec:
                print(f"| the job's record: detect / relaunch / redo | {rec['detect_seconds']:.3f} / "
                      f"{rec['relaunch_seconds']:.3f} / {rec['redo_seconds']:.3f} s |")

            # a queue of requests at once
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(a.queue) as pool:
                res = list(pool.map(served, range(300, 300 + a.queue)))
            wall = time.perf_counter() - t0
            waits = [m["queue_seconds"] for _, _, m in res]
            print(f"\n| {a.queue} requests at once | |\n|---|---|")
            print(f"| direct, one after another | {sum(seq):.3f} s ({a.queue / sum(seq):.3f} images/s) |")
            print(f"| service, all queued at once | {wall:.3f} s ({a.queue / wall:.3f} images/s) |")
            print(f"| queue wait: first / last | {min(waits):.3f} / {max(waits):.3f} s |")
        finally:
            rc = api.stop()
            print(f"\nservice exit status {rc}")


if __name__ == "__main__":
    main()
