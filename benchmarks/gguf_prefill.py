"""The exact GGUF kernel on a prompt's rows (a prefill), against PyTorch's fp32 matmul on the same matrices (issue 48).

Each round multiplies ``--rows`` rows of random activations by every layer matrix of a GGUF file in turn (the
embedding table and the output head excepted: a prefill reads rows of the one and multiplies one row by the other),
interleaved: the exact kernel on the file's blocks (``weights="gguf"``, the default mode), then ``torch.matmul`` on the
same matrix dequantized to fp32 (held only while it is timed). Both do the same multiply-adds; the matmul's own order,
not the exact kernel's chains. Per matrix shape, the median over rounds of the time and the billions of multiply-adds
per second; then the sum over the layers. Beside them, the ceiling: one core's fp32 multiply-adds per second on
registers alone (``benchmarks/fma_peak.cpp``, built at the start with the machine's flags), measured before and after
the rounds. Usage::

    python benchmarks/gguf_prefill.py --target qwen2.5-coder-1.5b-instruct --threads 1 --rows 48,64,96,156
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def fma_peak_gfma() -> float:
    """One core's fp32 multiply-adds per second, in billions (benchmarks/fma_peak.cpp): the best of 5 runs of 0.1 s."""
    from torch.utils.cpp_extension import load

    here = os.path.dirname(os.path.abspath(__file__))
    module = load("ois_bench_fma_peak", [os.path.join(here, "fma_peak.cpp")], extra_cflags=["-O3", "-march=native"],
                  verbose=False)
    module.fma_peak(1_000_000)  # warm: the core's clock settles
    return max(module.fma_peak(2_000_000) for _ in range(5))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a provisioned name or a .gguf path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="156",
                        help="rows of activations (the prompt's tokens); several, comma-separated, for a table each")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.rows.split(",")]

    import torch

    from optimum_ipex_spec.backends.pytorch import gguf_weights
    from optimum_ipex_spec.kernels import gguf as gguf_kernels
    from optimum_ipex_spec.provisioning.provision import gguf_path

    torch.set_num_threads(args.threads)
    peak_before = fma_peak_gfma()
    kernel = gguf_kernels.exact_kernel()
    path = args.target if args.target.endswith(".gguf") else str(gguf_path(args.target))
    gguf = gguf_weights.read_gguf(path)
    layers = [(name, info) for name, info in gguf.tensors.items()
              if name.startswith("blk.") and info.block.name not in ("F32", "F16")]
    kinds = {}  # (short name, type, rows, k) -> layer names
    for name, info in layers:
        kinds.setdefault((name.split(".", 2)[2], info.block.name, info.rows, info.k), []).append(name)
    widths = {info.k for _, info in layers}
    x = {(m, k): torch.randn(m, k, generator=torch.Generator().manual_seed(0)) for m in counts for k in widths}
    times = {(m, key): {"exact": [], "matmul": []} for m in counts for key in kinds}
    for _ in range(args.rounds):
        for m in counts:
            for key, names in kinds.items():
                info = gguf.tensors[names[0]]
                blocks = gguf.blocks(names[0])
                start = time.perf_counter()
                gguf_kernels.exact_mm(kernel, x[m, info.k], blocks, info.block.qtype, info.k)
                times[m, key]["exact"].append(time.perf_counter() - start)
                dense = gguf_kernels.exact_dequantize(kernel, blocks, info.block.qtype, info.k)
                start = time.perf_counter()
                torch.matmul(x[m, info.k], dense.t())
                times[m, key]["matmul"].append(time.perf_counter() - start)
                del dense
    peaks = (peak_before, fma_peak_gfma())
    peak = max(peaks)
    print(f"- One core's fp32 multiply-adds on registers alone (benchmarks/fma_peak.cpp): {peaks[0]:.1f} and "
          f"{peaks[1]:.1f} billion per second, before and after the rounds.")
    for m in counts:
        print(f"\n### Prefill of {m} rows, {os.path.basename(path)}, {args.threads} thread(s), exact kernel {kernel}, "
              f"torch {torch.__version__}, median of {args.rounds} rounds\n")
        print("| matrix | type | rows x k | layers | exact kernel ms | GFMA/s | fp32 matmul ms | GFMA/s |")
        print("|---|---|---|---|---|---|---|---|")
        total = {"exact": 0.0, "matmul": 0.0}
        fmas = 0
        for (short, type_name, rows, k), names in sorted(kinds.items()):
            median = {how: statistics.median(t) for how, t in times[m, (short, type_name, rows, k)].items()}
            fma = m * rows * k
            fmas += fma * len(names)
            for how in total:
                total[how] += median[how] * len(names)
            rates = {how: fma / median[how] / 1e9 for how in median}
            print(f"| {short} | {type_name} | {rows} x {k} | {len(names)} | {median['exact'] * 1e3:.2f} | "
                  f"{rates['exact']:.1f} | {median['matmul'] * 1e3:.2f} | {rates['matmul']:.1f} |")
        rates = {how: fmas / total[how] / 1e9 for how in total}
        print(f"| every layer matrix | | | {len(layers)} | {total['exact'] * 1e3:.0f} | {rates['exact']:.1f} | "
              f"{total['matmul'] * 1e3:.0f} | {rates['matmul']:.1f} |")
        print(f"\n- Of the higher rate above: the exact kernel {rates['exact'] / peak:.0%}, the fp32 matmul "
              f"{rates['matmul'] / peak:.0%}; these products on {args.threads} thread(s) at that rate would take "
              f"{fmas / peak / 1e9 / args.threads:.2f} s.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
