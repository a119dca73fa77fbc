"""What one pass over a model's matrices costs on optimum_ipex_spec.kernels.packed_gemm's kernel, per row count
and dtype.

The memory side of the compiled decode step (torch_compile=True): each of the model's projections and its LM head
(random weights of its config's shapes) multiplied once per pass by ``rows`` rows, through ``PackedLinear`` (the
kernel a compiled graph calls; here called from Python, a few microseconds each), against ``F.linear`` on the plain
weights, and a plain ``sum`` over as many fp32 bytes: the speed one thread reads memory at here. Median of
``--repeats`` passes, 1 thread, the kernels interleaved.

    python benchmarks/packed_gemm_rows.py [--model smollm2-135m-instruct] [--rows 1 4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from linear_rows import decoder_shapes, pass_seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or folder (its config only)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from optimum_ipex_spec.kernels.packed_gemm import PackedLinear, packed_gemm_available
    from optimum_ipex_spec.provisioning.provision import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(args.model)).get_text_config()
    shapes = decoder_shapes(config) * config.num_hidden_layers + [(config.vocab_size, config.hidden_size)]
    print(f"{args.model}: {config.num_hidden_layers} layers and the LM head, 1 thread, median of {args.repeats} "
          "passes; ms per pass (GB/s of weights read)")
    print("| dtype | kernel | " + " | ".join(f"{rows} row(s)" for rows in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for name in args.dtypes:
        dtype = getattr(torch, name)
        if not packed_gemm_available(dtype):
            print(f"| {name} | packed kernel unavailable here (see the log) |" + " |" * len(args.rows))
            continue
        plain = [torch.nn.Linear(i, o, bias=False, dtype=dtype) for o, i in shapes]
        packed = [PackedLinear(linear.weight) for linear in plain]
        nbytes = sum(linear.weight.nbytes for linear in plain)
        flat = torch.randn(nbytes // 4)
        results = {"packed_mm": {}, "F.linear": {}, "sum (fp32, same bytes)": {}}
        for rows in args.rows:
            for _ in range(2):  # interleaved; each kernel's faster round of two
                for kernel, modules in (("packed_mm", packed), ("F.linear", plain)):
                    seconds = pass_seconds(modules, rows, args.repeats, dtype)
                    results[kernel][rows] = min(results[kernel].get(rows, seconds), seconds)
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    flat.sum()
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times)
                results["sum (fp32, same bytes)"][rows] = min(results["sum (fp32, same bytes)"].get(rows, seconds),
                                                              seconds)
        for kernel, by_rows in results.items():
            cells = [f"{1e3 * s:.1f} ({nbytes / s / 1e9:.1f})" for s in by_rows.values()]
            print(f"| {name} | {kernel} | " + " | ".join(cells) + " |")
        del plain, packed, flat
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
