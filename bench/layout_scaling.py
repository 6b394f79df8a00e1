#!/usr/bin/env python3
"""One rank against the 2-rank layouts on a Flux checkpoint, alternating rounds, with the step
accounted per kernel class: a markdown table of step medians, the report's kernel seconds (linear
and attention with their GFLOP/s), the time outside kernels (collectives not hidden, agreement
reductions, CP gathers, dispatch) and each layout's speed-up over one rank in each round, plus the
one-rank rate as a fraction of this core's FMA peak (bench_sgemm, same run). The kernel seconds,
the time outside them and the seconds blocked in each collective kind and in the world's agreement
(`wait_seconds_last_step`) are all of the report's last step, so they add up to its wall time
(`last_step_seconds`); the rest outside kernels is copies, staging and dispatch. The kernel
seconds of every rank (fastest / slowest) show ranks doing the same work at different speeds: what
the faster waits for in the collectives. Per forward, the report's steal (the most any rank's vCPU
lost to the hypervisor) splits the forwards into those nothing was stolen from and the others, each
with its scaling, and each run's steal per vCPU from /proc/stat is listed. --pair runs, each round,
two one-rank copies at once (no MPI between them): the same work per vCPU as one rank alone with
both vCPUs busy, so 2 x alone / at once is what the host lets any 2-rank layout reach. Benchmarks
only
(never in make test); the standard library only (no torch).

With --pack-compare every layout also runs with the linears' weights kept plain
(MESHDIT_CPU_PACK=off), alternating with the default (packed where the GEMM path packs), and a
second table gives both steps, the packed speed-up and both scalings. --baseline BIN does the same
with another meshdit binary (an earlier build: `git worktree add /tmp/base REV && make -C
/tmp/base build/meshdit`) in place of the plain weights: a change's speed-up and scalings, in one
sitting.

usage: python3 bench/layout_scaling.py [--preset medium] [--rounds 2] [--repeat 3]
           [--layouts "2,1,1 1,1,2 1,2,1"] [--img-tokens 1024] [--txt-tokens 256]
           [--pack-compare | --baseline /tmp/base/build/meshdit] [--pair]
Run with OPENBLAS_CORETYPE unset (the script unsets it) and one thread per rank; needs
build/meshdit and build/bench/bench_sgemm (`make bench`) and MPICH's mpiexec (MPIEXEC overrides).
"""
import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgemm_rate import sgemm_rate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_steal():
    """Seconds the hypervisor ran something else while each vCPU wanted to run (/proc/stat's
    steal column, per cpuN line), or None where there is no such file (not Linux)."""
    try:
        with open("/proc/stat") as f:
            rows = [ln.split() for ln in f if re.match(r"cpu\d+ ", ln)]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return [int(x[8]) / hz if len(x) > 8 else 0.0 for x in rows]


# one run's figures: the step median, rank 0's kernel seconds, FLOPs, last step and waits, the
# ranks' kernel seconds (fastest, slowest), rank 0's forwards in order, each vCPU's steal over
# the whole run (/proc/stat) and its wall seconds, the report's steal per forward, and per rank
# (kernel seconds, steal) of the last step
Run = collections.namedtuple("Run", "step kernel flops last wait spread forwards vcpu_steal wall "
                                    "steal rank_steal")


def run_cmd(a, tmp, name, binary=None):
    """The `meshdit run` command of one timed run and its report's path."""
    report = os.path.join(tmp, f"report_{name}.json")
    return [binary or a.meshdit, "run", "--checkpoint", os.path.join(tmp, "ckpt"), "--inputs",
            os.path.join(tmp, "in.safetensors"), "--out", os.path.join(tmp, f"out_{name}.st"),
            "--repeat", str(a.repeat + 1), "--report", report, "--quiet"], report


def run_layout(a, env, tmp, t, r, u, tag, pack=None, binary=None):
    n = t * r * u
    cmd, report = run_cmd(a, tmp, f"{t}{r}{u}_{tag}", binary)
    cmd += ["--tp", str(t), "--ring", str(r), "--ulysses", str(u)]
    if n > 1:
        cmd = [a.mpiexec, "-n", str(n)] + cmd
    if pack:
        env = dict(env, MESHDIT_CPU_PACK=pack)
    st0, w0 = cpu_steal(), time.monotonic()
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    st1, wall = cpu_steal(), time.monotonic() - w0
    # the vCPUs' stolen seconds during the whole run (load and warm-up too), per vCPU
    steal = [y - x for x, y in zip(st0, st1)] if st0 and st1 else None
    with open(report) as f:
        d = json.load(f)
    rk = d["ranks"][0]
    # every rank's kernel seconds: ranks doing the same work at different speeds (the spread)
    ks = [sum(x["kernel_seconds_per_step"].values()) for x in d["ranks"]]
    # ... and each rank's vCPU's steal in that step: kernel seconds are wall seconds, so a rank
    # the host stole from runs its kernels longer by about that much
    sl = [x.get("steal_seconds_last_step") for x in d["ranks"]]
    return Run(d["step_seconds_median"], rk["kernel_seconds_per_step"], rk["flops_per_step"],
               rk["last_step_seconds"], rk["wait_seconds_last_step"], (min(ks), max(ks)),
               d.get("step_seconds", []), steal, wall, d.get("steal_seconds", []),
               list(zip(ks, sl)))


def run_pair(a, env, tmp, tag):
    """Two one-rank runs at once (no MPI between them): each copy's forwards (warm-ups left out)
    and steal per forward. The same work per vCPU as one rank alone, both vCPUs busy: what the
    host gives two busy vCPUs, the ceiling of any 2-rank layout here."""
    procs, reports = [], []
    for c in range(2):
        cmd, rep = run_cmd(a, tmp, f"pair{c}_{tag}")
        reports.append(rep)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    for pr in procs:
        _, err = pr.communicate()
        if pr.returncode != 0:
            raise SystemExit(f"pair run failed: {err.strip()}")
    out = []
    for rep in reports:
        with open(rep) as f:
            d = json.load(f)
        out.append((d["step_seconds"][1:], (d.get("steal_seconds") or [])[1:]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--layouts", default="2,1,1 1,1,2 1,2,1", help="tp,ring,ulysses ...")
    p.add_argument("--img-tokens", type=int, default=1024)
    p.add_argument("--txt-tokens", type=int, default=256)
    p.add_argument("--pack-compare", action="store_true",
                   help="also run every layout with plain weights (MESHDIT_CPU_PACK=off)")
    p.add_argument("--baseline", help="another meshdit binary, alternating with --meshdit")
    p.add_argument("--pair", action="store_true",
                   help="each round also runs two one-rank copies at once: the host's ceiling")
    p.add_argument("--meshdit", default=os.path.join(ROOT, "build", "meshdit"))
    p.add_argument("--sgemm", default=os.path.join(ROOT, "build", "bench", "bench_sgemm"))
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC") or
                   shutil.which("mpiexec.mpich") or "mpiexec")
    a = p.parse_args()
    if a.pack_compare and a.baseline:
        p.error("--pack-compare and --baseline: one comparison at a time")
    layouts = [(1, 1, 1)]
    for s in a.layouts.split():
        t, r, u = (int(x) for x in s.split(","))
        layouts.append((t, r, u))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("OPENBLAS_CORETYPE", None)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([a.meshdit, "gen", "--model", "flux", "--preset", a.preset, "--out",
                        os.path.join(tmp, "ckpt")], env=env, check=True, capture_output=True)
        subprocess.run([a.meshdit, "inputs", "--checkpoint", os.path.join(tmp, "ckpt"), "--out",
                        os.path.join(tmp, "in.safetensors"), "--img-tokens", str(a.img_tokens),
                        "--txt-tokens", str(a.txt_tokens)], env=env, check=True,
                       capture_output=True)
        sgemm, peak, _, _, _, cpu = sgemm_rate(a.sgemm, env)
        res = {lay: [] for lay in layouts}
        plain = {lay: [] for lay in layouts}
        pairs = []
        for rnd in range(a.rounds):  # alternating: every layout once per round
            for lay in layouts:
                if a.pack_compare or a.baseline:  # the other first in even rounds
                    order = ("off", "auto") if rnd % 2 == 0 else ("auto", "off")
                    for v in order:
                        if a.baseline:
                            x = run_layout(a, env, tmp, *lay, f"{rnd}{v}",
                                           binary=a.baseline if v == "off" else None)
                        else:
                            x = run_layout(a, env, tmp, *lay, f"{rnd}{v}", v)
                        (plain if v == "off" else res)[lay].append(x)
                else:
                    res[lay].append(run_layout(a, env, tmp, *lay, rnd))
                if a.pair and lay == (1, 1, 1):
                    pairs.append(run_pair(a, env, tmp, rnd))
    print(f"Flux preset {a.preset}, {a.img_tokens} + {a.txt_tokens} tokens; cpu: {cpu}; "
          f"fma peak {peak} GFLOP/s, sgemm {sgemm} GFLOP/s; {a.rounds} rounds x {a.repeat} "
          f"forwards; rank 0's kernel seconds, last round")
    one = [x[0] for x in res[(1, 1, 1)]]
    gflop = sum(res[(1, 1, 1)][0][2].values()) / 1e9
    print(f"one rank: {gflop:.2f} GFLOP per forward, best {gflop / min(one):.1f} GFLOP/s"
          + (f" = {100 * gflop / min(one) / peak:.1f}% of the FMA peak" if peak else ""))
    print("| layout | step s (median) | last step s | linear s (GFLOP/s) | attention s (GFLOP/s) "
          "| other s | outside kernels s | blocked: agreement / all-to-all / all-reduce / "
          "send-recv / all-gather s | rest outside s | kernel s per rank, fastest / slowest "
          "| steal s per rank (its kernel s) | speed-up per round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lay in layouts:
        step, k, f, last, w, spread = res[lay][-1][:6]
        rate = lambda c: f[c] / k[c] / 1e9 if k[c] > 0 else 0.0
        ups = " / ".join(f"{one[i] / x[0]:.2f}x" for i, x in enumerate(res[lay]))
        outside = last - sum(k.values())
        blocked = sum(w.values())
        parts = " / ".join(f"{w[c]:.3f}" for c in ("agreement", "alltoall", "allreduce",
                                                     "sendrecv", "allgather"))
        print(f"| tp{lay[0]} ring{lay[1]} ulysses{lay[2]} | {step:.3f} | {last:.3f} | "
              f"{k['linear']:.3f} ({rate('linear'):.1f}) | {k['attention']:.3f} "
              f"({rate('attention'):.1f}) | {k['other']:.3f} | {outside:.3f} | {parts} | "
              f"{outside - blocked:.3f} | {spread[0]:.3f} / {spread[1]:.3f} | "
              + ", ".join("?" if st is None else f"{st:.2f} ({kk:.3f})"
                          for kk, st in res[lay][-1].rank_steal)
              + f" | {ups} |")
    print("medians of the step per layout:",
          ", ".join(f"tp{t}r{r}u{u} {statistics.median(x[0] for x in res[(t, r, u)]):.3f}"
                    for t, r, u in layouts))
    # every forward of every run, in order (rank 0's; the first is the run's warm-up): a round
    # whose median sits above its best forwards had one or two slow forwards, which the
    # last-step accounting above does not see; the best forward's scaling shows the layout
    # without them
    print("\nforward seconds in order, per round (rank 0's), and the scaling of the best forward "
          "of each run against one rank's best:")
    best1 = [min(x[6]) if x[6] else x[0] for x in res[(1, 1, 1)]]
    for lay in layouts:
        runs = " \\| ".join(" ".join(f"{t:.3f}" for t in x[6]) for x in res[lay])
        sc = "" if lay == (1, 1, 1) else "; best: " + " / ".join(
            f"{b / (min(x[6]) if x[6] else x[0]):.2f}x" for b, x in zip(best1, res[lay]))
        print(f"- tp{lay[0]} ring{lay[1]} ulysses{lay[2]}: {runs}{sc}")
    # per forward the most any rank's vCPU lost to the hypervisor (the report's steal_seconds,
    # 10 ms ticks): the scaling of the forwards nothing was stolen from against those with steal,
    # each against one rank's median forward (warm-ups left out)
    def fwd(x):
        return list(zip(x.forwards[1:], (x.steal or [None] * len(x.forwards))[1:]))
    one_fwd = statistics.median(t for x in res[(1, 1, 1)] for t, _ in fwd(x))
    print("\nper forward (warm-ups left out): the most steal any rank's vCPU saw, and the scaling "
          f"against one rank's median forward ({one_fwd:.3f} s):")
    print("| layout | forwards without steal: n, scaling median (range) | with steal: n, steal ms "
          "median, scaling median (range) |")
    print("|---|---|---|")
    for lay in layouts:
        if lay == (1, 1, 1):
            continue
        f = [(t, st) for x in res[lay] for t, st in fwd(x) if st is not None]
        cells = []
        for sel in (lambda st: st == 0, lambda st: st > 0):
            g = [(one_fwd / t, st) for t, st in f if sel(st)]
            sc = [v for v, _ in g]
            cells.append(f"{len(g)}" + (f", {1000 * statistics.median(st for _, st in g):.0f}"
                                        if g and g[0][1] > 0 else "")
                         + (f", {statistics.median(sc):.2f}x ({min(sc):.2f}–{max(sc):.2f}x)"
                            if sc else ""))
        print(f"| tp{lay[0]} ring{lay[1]} ulysses{lay[2]} | {cells[0]} | {cells[1]} |")
    if pairs:
        # per round: the copies' median forward against one rank alone in the same round; the
        # 2-rank ceiling is 2 x alone / at once (each copy does one rank's whole work)
        print("\ntwo one-rank copies at once (--pair), per round: median forward per copy, "
              "one rank alone, the ceiling 2 x alone / at once, and the copies' steal ms median")
        for rnd, pr in enumerate(pairs):
            alone = statistics.median(res[(1, 1, 1)][rnd].forwards[1:])
            meds = [statistics.median(t) for t, _ in pr]
            st = [v for _, s in pr for v in s if v is not None]
            print(f"- round {rnd}: " + " / ".join(f"{m:.3f}" for m in meds)
                  + f" s; alone {alone:.3f} s; ceiling {2 * alone / max(meds):.2f}x; steal "
                  + (f"{1000 * statistics.median(st):.0f} ms" if st else "n/a")
                  + " per forward; forwards without steal "
                  + f"{sum(1 for v in st if v == 0)} of {len(st)}")
    # the hypervisor's steal during each run, per vCPU: a 2-rank round below the others with
    # steal on one vCPU lost that time to another guest, not to the mesh
    print("\nsteal per run (/proc/stat, whole run incl. load and warm-up), ms per vCPU, and the "
          "run's wall s:")
    for lay in layouts:
        cells = []
        for x in res[lay]:
            cells.append(("/".join(f"{1000 * v:.0f}" for v in x.vcpu_steal)
                          if x.vcpu_steal is not None else "n/a") + f" in {x.wall:.1f}")
        print(f"- tp{lay[0]} ring{lay[1]} ulysses{lay[2]}: " + " \\| ".join(cells))
    if a.pack_compare or a.baseline:
        p1 = [x[0] for x in plain[(1, 1, 1)]]
        o, n = ("plain weights", "packed") if a.pack_compare else ("baseline", "this build")
        if a.baseline:
            print(f"baseline: {a.baseline}; this build: {a.meshdit}")
        print(f"\n| layout | {o} step s (median) | {n} step s (median) | {n} "
              f"speed-up per round | scaling {o} per round | scaling {n} per round | linear s, "
              f"{o} / {n} (median over rounds) |")
        print("|---|---|---|---|---|---|---|")
        for lay in layouts:
            pl, pk = [x[0] for x in plain[lay]], [x[0] for x in res[lay]]
            lin = [statistics.median(x[1]["linear"] for x in v[lay]) for v in (plain, res)]
            print(f"| tp{lay[0]} ring{lay[1]} ulysses{lay[2]} | {statistics.median(pl):.3f} | "
                  f"{statistics.median(pk):.3f} | "
                  + " / ".join(f"{x / y:.3f}x" for x, y in zip(pl, pk)) + " | "
                  + " / ".join(f"{o / x:.2f}x" for o, x in zip(p1, pl)) + " | "
                  + " / ".join(f"{o / x:.2f}x" for o, x in zip(one, pk))
                  + f" | {lin[0]:.3f} / {lin[1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
