#!/usr/bin/env python3
"""Renders `meshdit plan` predictions to a PNG: predicted step time against device count, one
line per layout family (the best layout of that family at each count), so a user can see where
each layout wins; measured points (seconds per step at a device count) are drawn on top.

usage: python3 scripts/plot_plan.py --config FILE --device h200 --out docs/plan.png
           [--tokens S] [--devices 1,2,4,8,16,32,64] [--measured N:SECONDS,...] [--title T]
Needs matplotlib (a venv); not part of `make test`.
"""
import argparse
import re
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROW = re.compile(r"^(\d+) x (\d+) x (\d+)\s+.*\s([0-9.]+)(\s+<- best)?$")


def family(t, r, u):
    parts = [name for name, d in (("TP", t), ("Ring", r), ("Ulysses", u)) if d > 1]
    return " x ".join(parts) if parts else "single device"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--device", default="h200")
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--devices", default="1,2,4,8,16,32,64")
    ap.add_argument("--measured", default="", help="N:SECONDS,... measured steps to overlay")
    ap.add_argument("--measured-label", default="measured")
    ap.add_argument("--title", default="")
    ap.add_argument("--meshdit", default="build/meshdit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    best = {}  # family -> {devices: seconds}
    for n in [int(x) for x in args.devices.split(",")]:
        cmd = [args.meshdit, "plan", "--config", args.config, "--devices", str(n), "--device",
               args.device]
        if args.tokens:
            cmd += ["--tokens", str(args.tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            m = ROW.match(line.strip())
            if not m:
                continue
            t, r, u, step = int(m[1]), int(m[2]), int(m[3]), float(m[4])
            fam = family(t, r, u)
            if step < best.setdefault(fam, {}).get(n, float("inf")):
                best[fam][n] = step
    fig, ax = plt.subplots(figsize=(8, 5))
    for fam, pts in sorted(best.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=fam)
    if args.measured:
        pts = [tuple(float(v) for v in p.split(":")) for p in args.measured.split(",")]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="*", s=160, color="black",
                   zorder=5, label=args.measured_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("predicted seconds per step")
    ax.set_title(args.title or f"meshdit plan: {args.config} on {args.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
