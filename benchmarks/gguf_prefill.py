"""The exact GGUF kernel on a prompt's rows (a prefill), against PyTorch's fp32 matmul on the same matrices (issue 48).

Each round multiplies ``--rows`` rows of random activations by every layer matrix of a GGUF file in turn (the
embedding table and the output head excepted: a prefill reads rows of the one and multiplies one row by the other),
interleaved: the exact kernel on the file's blocks (``weights="gguf"``, the default mode), then ``torch.matmul`` on the
same matrix dequantized to fp32 (held only while it is timed). Both do the same multiply-adds; the matmul's own order,
not the exact kernel's chains. Per matrix shape, the median over rounds of the time and the billions of multiply-adds
per second; then the sum over the layers. Usage::

    python benchmarks/gguf_prefill.py --target qwen2.5-coder-1.5b-instruct --threads 1 --rows 156
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a provisioned name or a .gguf path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=156, help="rows of activations (the prompt's tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from optimum_ipex_spec import gguf_weights
    from optimum_ipex_spec.provision import gguf_path

    torch.set_num_threads(args.threads)
    kernel = gguf_weights.exact_kernel()
    path = args.target if args.target.endswith(".gguf") else str(gguf_path(args.target))
    gguf = gguf_weights.read_gguf(path)
    layers = [(name, info) for name, info in gguf.tensors.items()
              if name.startswith("blk.") and info.block.name not in ("F32", "F16")]
    kinds = {}  # (short name, type, rows, k) -> layer names
    for name, info in layers:
        kinds.setdefault((name.split(".", 2)[2], info.block.name, info.rows, info.k), []).append(name)
    x = {k: torch.randn(args.rows, k, generator=torch.Generator().manual_seed(0)) for k in {i.k for _, i in layers}}
    times = {key: {"exact": [], "matmul": []} for key in kinds}
    for _ in range(args.rounds):
        for key, names in kinds.items():
            info = gguf.tensors[names[0]]
            blocks = gguf.blocks(names[0])
            start = time.perf_counter()
            gguf_weights.exact_mm(kernel, x[info.k], blocks, info.block.qtype, info.k)
            times[key]["exact"].append(time.perf_counter() - start)
            dense = gguf_weights.exact_dequantize(kernel, blocks, info.block.qtype, info.k)
            start = time.perf_counter()
            torch.matmul(x[info.k], dense.t())
            times[key]["matmul"].append(time.perf_counter() - start)
            del dense
    print(f"### Prefill of {args.rows} rows, {path.rsplit('/', 1)[-1]}, {args.threads} thread(s), exact kernel "
          f"{kernel}, torch {torch.__version__}, median of {args.rounds} rounds\n")
    print("| matrix | type | rows x k | layers | exact kernel ms | GFMA/s | fp32 matmul ms | GFMA/s |")
    print("|---|---|---|---|---|---|---|---|")
    total = {"exact": 0.0, "matmul": 0.0}
    fmas = 0
    for (short, type_name, rows, k), names in sorted(kinds.items()):
        median = {how: statistics.median(t) for how, t in times[(short, type_name, rows, k)].items()}
        fma = args.rows * rows * k
        fmas += fma * len(names)
        for how in total:
            total[how] += median[how] * len(names)
        rates = {how: fma / median[how] / 1e9 for how in median}
        print(f"| {short} | {type_name} | {rows} x {k} | {len(names)} | {median['exact'] * 1e3:.2f} | "
              f"{rates['exact']:.1f} | {median['matmul'] * 1e3:.2f} | {rates['matmul']:.1f} |")
    print(f"| every layer matrix | | | {len(layers)} | {total['exact'] * 1e3:.0f} | "
          f"{fmas / total['exact'] / 1e9:.1f} | {total['matmul'] * 1e3:.0f} | {fmas / total['matmul'] / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
