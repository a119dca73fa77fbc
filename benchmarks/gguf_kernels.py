"""Our GGUF kernels alone, on every matrix of a GGUF file in turn, as a decode step reads them (issue 48).

One pass multiplies 1 (a decode step) or 4 (a verification of 3 draft tokens) rows of random activations by every
quantized matrix of the file (the embedding table excepted: a step reads one of its rows), each matrix the private
memory map the model uses, so a pass streams the file's bytes per token from memory. Per kernel (exact, fast) and row
count (the fast kernel both as the fast mode holds its layers, interleaved 16 rows per vector, and row-major as in
the file): the median pass time over interleaved rounds, the bytes it read per second, and beside them the read
bandwidth of a plain ``sum`` over 512 MB measured in the same run (the one-token roofline is the file's bytes over
it). The 4-row pass over the 1-row one is a verification's cost in decode steps on these kernels alone. Usage::

    python benchmarks/gguf_kernels.py --target qwen2.5-coder-1.5b-instruct --threads 1
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

from bench import measure_bandwidth_gbs  # benchmarks/bench.py, beside this file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a provisioned name or a .gguf path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)

    import torch

    from optimum_ipex_spec.backends.pytorch import gguf_weights
    from optimum_ipex_spec.kernels import gguf as gguf_kernels
    from optimum_ipex_spec.provisioning.provision import gguf_path

    torch.set_num_threads(args.threads)
    path = args.target if args.target.endswith(".gguf") else str(gguf_path(args.target))
    gguf = gguf_weights.read_gguf(path)
    matrices = [(gguf.blocks(name), info) for name, info in gguf.tensors.items()
                if info.rows > 1 and info.block.values > 1 and not name.startswith("token_embd")]
    total = sum(blocks.numel() for blocks, _ in matrices)
    kernels = {}  # mode -> one callable per matrix, x -> x @ W.T
    isa = gguf_kernels.exact_kernel()  # "avx512", "avx2" (OPTIMUM_IPEX_SPEC_GGUF_KERNEL picks another) or None
    if isa is not None:
        kernels[f"exact ({isa})"] = [functools.partial(gguf_kernels.exact_mm, isa, blocks=b, qtype=i.block.qtype,
                                                       k=i.k) for b, i in matrices]
    fast_isa = gguf_kernels.fast_kernel()  # "avx512" (VNNI), "avx2" or None
    if fast_isa is not None:
        fast = getattr(torch.ops, gguf_kernels.FAST_KERNELS[fast_isa].namespace)
        kernels[f"fast ({fast_isa}), row-major"] = [functools.partial(fast.mm, blocks=b, qtype=i.block.qtype, K=i.k)
                                                    for b, i in matrices]
        # as the fast mode holds them (GGUFLinear decides: interleaved 16 rows at a time where it can, a copy)
        kernels[f"fast ({fast_isa})"] = [gguf_weights.GGUFLinear(b, i.block, i.k, mode="fast") for b, i in matrices]
    if not kernels:
        print("no GGUF kernel runs here (AVX2 or AVX-512, and a C++ compiler, are needed)", file=sys.stderr)
        return 1
    inputs = {rows: {k: torch.randn(rows, k) for k in {info.k for _, info in matrices}} for rows in (1, 4)}

    def one_pass(kernel, rows: int) -> float:
        start = time.perf_counter()
        for multiply, (_, info) in zip(kernel, matrices):
            multiply(inputs[rows][info.k])
        return time.perf_counter() - start

    times = {(mode, rows): [] for mode in kernels for rows in (1, 4)}
    bandwidth = []
    for mode, kernel in kernels.items():  # warm: the extension loaded, the file's pages in the page cache
        one_pass(kernel, 1)
    for _ in range(args.rounds):
        bandwidth.append(measure_bandwidth_gbs())
        for (mode, rows), samples in times.items():
            samples.append(one_pass(kernels[mode], rows))
    read = statistics.median(bandwidth)
    print(f"{path}: {len(matrices)} matrices, {total / 1e9:.3f} GB per token; {args.threads} thread(s); "
          f"plain read {read:.1f} GB/s, so the one-token roofline is {read * 1e9 / total:.1f} tokens/s\n")
    print("| kernel | rows | pass ms | GB/s | share of the read bandwidth | 4 rows / 1 row |")
    print("|---|---|---|---|---|---|")
    for (mode, rows), samples in times.items():
        seconds = statistics.median(samples)
        ratio = seconds / statistics.median(times[(mode, 1)])
        print(f"| {mode} | {rows} | {seconds * 1e3:.1f} | {total / seconds / 1e9:.1f} | "
              f"{total / seconds / 1e9 / read:.0%} | x{ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
