"""What one pass over a model's decoder matrices costs per row count, for each fp32 linear kernel IPEX offers.

A lead, not a feature: on an AMD EPYC Zen 4 (1 thread) IPEX's fp32 kernels ran 2 or 4 rows faster than 1 (MKL's
packed GEMM: 27 ms for 2 rows against 40-44 for 1 over SmolLM2's shapes; oneDNN: 28-30 ms for 3-4 rows against
35-38 for 1), so a decode step that padded its one row might run its projections 20-35% faster. Random weights of
the model's shapes (from its config; no LM head), each matrix multiplied once per pass, the kernels interleaved,
median of ``--repeats`` passes.

    python benchmarks/linear_rows.py [--model smollm2-135m-instruct] [--rows 1 2 3 4 5 9] [--repeats 40]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def decoder_shapes(config):
    """``[(out, in)]`` of one decoder layer's projections (q, k, v, o, gate, up, down)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]


def pass_seconds(layers, rows: int, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of ``repeats`` passes, each calling every layer once on ``rows`` random rows of ``dtype``."""
    inputs = {}
    for layer in layers:
        inputs.setdefault(layer.in_features, torch.randn(rows, layer.in_features, dtype=dtype))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or folder (its config only)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 9])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import intel_extension_for_pytorch as ipex
    from transformers import AutoConfig

    from optimum_ipex_spec.provisioning.provision import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(args.model)).get_text_config()
    plain = torch.nn.Module()  # a container only (ipex.optimize would trace a Sequential into a GraphModule)
    plain.layers = torch.nn.ModuleList([torch.nn.Linear(i, o, bias=False) for _ in range(config.num_hidden_layers)
                                        for (o, i) in decoder_shapes(config)])
    plain.eval()
    kernels = {
        "IPEX, MKL packed (ipex.optimize default)": ipex.optimize(copy.deepcopy(plain), dtype=torch.float32),
        "IPEX, oneDNN (auto_kernel_selection)": ipex.optimize(copy.deepcopy(plain), dtype=torch.float32,
                                                              auto_kernel_selection=True),
        "F.linear": plain,
    }
    weight_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    print(f"{args.model}: {config.num_hidden_layers} layers, {weight_bytes / 1e6:.0f} MB of fp32 decoder weights, "
          f"1 thread, median of {args.repeats}; ms per pass (GB/s of weights read)")
    print("| kernel | " + " | ".join(f"{rows} row(s)" for rows in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    results = {name: {} for name in kernels}
    for rows in args.rows:
        for name, model in kernels.items():
            results[name][rows] = pass_seconds(list(model.layers), rows, args.repeats)
    for name, by_rows in results.items():
        cells = [f"{1e3 * s:.1f} ({weight_bytes / s / 1e9:.1f})" for s in by_rows.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
