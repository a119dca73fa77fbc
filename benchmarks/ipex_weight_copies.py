"""How many copies of its weights an IPEX-optimized, traced model keeps (issue 14), on 16 linear layers.

A model of ``--layers`` x ``Linear(--width, --width)`` without bias (256 MB in fp32 by default) goes through
``ipex.optimize`` (the call ``ipex.llm.optimize`` makes for the linear layers), ``torch.jit.trace`` and, in the
``frozen`` mode, ``torch.jit.freeze`` (what ``ipex.llm.optimize(deployment_mode=True)`` returns); then three runs.
Private memory (``/proc/self/smaps_rollup``, after ``gc`` and ``malloc_trim``) is printed after each step, as a
multiple of the weight bytes. One configuration per process::

    python benchmarks/ipex_weight_copies.py --mode frozen --dtype float32 --auto-kernel-selection
    python benchmarks/ipex_weight_copies.py --mode traced --dtype float32 --auto-kernel-selection

Measured 2026-11-30 (IPEX 2.8, 256 MB of fp32 weights), private memory after 3 runs: frozen 4.08x (default fp32
kernel: +1x at ipex.optimize, +2x at the first run), frozen with auto_kernel_selection 2.03x (+1x at the first run:
a second packed copy that stays), traced without freezing 0.85x (no copy); bf16 frozen 2.07x. See docs/memory.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc


def _private_bytes() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["frozen", "traced"], default="frozen")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--auto-kernel-selection", action="store_true",
                        help="oneDNN for fp32 linear layers (what ipex.llm.optimize uses for fp32)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args(argv)

    import torch

    import intel_extension_for_pytorch as ipex

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    base = _private_bytes()
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                                  for _ in range(args.layers)]).eval().to(dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def report(step: str) -> None:
        extra = _private_bytes() - base
        print(f"{step:28s} private {extra / 2**20:8.0f} MB = {extra / weights:4.2f} x the weights", flush=True)

    report("model built")
    x = torch.randn(1, args.width).to(dtype)
    with torch.no_grad():
        model = ipex.optimize(model, dtype=dtype, inplace=True, auto_kernel_selection=args.auto_kernel_selection)
        report("ipex.optimize")
        graph = torch.jit.trace(model, x)
        del model
        if args.mode == "frozen":
            graph = torch.jit.freeze(graph)
        report(f"{args.mode} graph")
        for _ in range(3):
            graph(x)
        report("after 3 runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
