"""The rates bench/bench_sgemm prints, parsed: shared by the benchmarks that report a fraction of
this machine's FMA peak or sgemm rate. The standard library only."""
import platform
import re
import subprocess


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), for a benchmark's header."""
    for ln in open("/proc/cpuinfo"):
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return platform.processor()


def sgemm_rate(path, env):
    """(sgemm median rate, FMA peak, bf16 dot peak or None, the GEMM path's f32 and bf16 rates
    (None where it has none), the cpu line) from bench/bench_sgemm."""
    out = subprocess.run([path, "3"], env=env, check=True, capture_output=True, text=True).stdout
    num = lambda pat: (lambda m: float(m.group(1)) if m else None)(re.search(pat, out))
    return (num(r"sgemm median rate: ([0-9.]+) GFLOP/s"), num(r"fma peak: ([0-9.]+) GFLOP/s"),
            num(r"bf16 dot peak: ([0-9.]+) GFLOP/s"), num(r"gemm f32 .* median rate: ([0-9.]+)"),
            num(r"gemm bf16 .* median rate: ([0-9.]+)"),
            re.search(r"^cpu: (.*)$", out, re.M).group(1))
