"""`make bench-ipex-woq`: IPEX's own weight-only quantization beside our quantized kernels, in the IPEX lane (issue 48).

IPEX 2.8's ``ipex.llm.optimize(model, quantization_config=...)`` with a weight-only qconfig
(``get_weight_only_quant_qconfig_mapping``) quantizes a dense checkpoint's linear layers at load (round to nearest, a
scale per group of input channels) and runs them with its fused LLM graphs. Measured here, interleaved per prompt, on
the same fp32 checkpoint (a provisioned folder), the same chat prompts and thread count, greedy:

* IPEX WOQ int4, computed with int8 activations (``lowp_mode=INT8``: llama.cpp's and our fast mode's arithmetic);
* IPEX WOQ int4 computed in the activations' dtype, fp32 (``lowp_mode=NONE``: our exact mode's arithmetic);
* ours on the checkpoint's GGUF file as shipped (``weights="gguf"``, exact and fast modes, compiled) and ours int4
  quantized at load from the same fp32 folder (``weights="int4"``, fast mode);
* the read bandwidth measured at the start of each round beside the bytes per token of ours (the one-token
  roofline; IPEX keeps its quantized weights inside its operators, where their bytes cannot be counted).

Each IPEX model is its own quantized model (its own rounding of the weights), so only speed is compared. With two IPEX
models of the 1.5B and ours the process held 20 GB (peak 23.5 GB: each fp32 checkpoint is read whole before IPEX
quantizes it); three IPEX models and ours did not fit in 24 GB. Needs the ipex28 lane (``OIS_LANE=ipex28``, IPEX
importable). IPEX's WOQ kernels are slow on an AVX2-only CPU (the 1.5B decoded 0.05 tokens/s there):
``--prompts 1 --new-tokens 8 --ours gguf-fast`` keeps the run near 20 minutes, most of it loading and compiling.
Usage::

    python benchmarks/ipex_woq.py --out docs/benchmarks-ipex-woq.md --json docs/benchmarks-ipex-woq.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from bench import measure_bandwidth_gbs  # benchmarks/bench.py, beside this file
from pair import _rss as _rss_gb  # benchmarks/pair.py: VmRSS and VmHWM in GB


def ipex_woq_model(folder: str, weight_dtype: str, lowp_mode: str, group_size: int):
    """The fp32 checkpoint at ``folder`` through ``ipex.llm.optimize`` with a weight-only qconfig (IPEX's own
    quantizer). IPEX keeps the quantized weights inside its operators' contexts, not as tensors a module lists: their
    bytes are not reported."""
    import intel_extension_for_pytorch as ipex
    import torch
    from intel_extension_for_pytorch.quantization import WoqLowpMode, WoqWeightDtype
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    qconfig = ipex.quantization.get_weight_only_quant_qconfig_mapping(
        weight_dtype=getattr(WoqWeightDtype, weight_dtype), lowp_mode=getattr(WoqLowpMode, lowp_mode),
        group_size=group_size)
    with torch.no_grad():
        return ipex.llm.optimize(model, dtype=torch.float32, quantization_config=qconfig, inplace=True,
                                 deployment_mode=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=32, help="IPEX WOQ: input channels per scale")
    parser.add_argument("--ours", default="gguf-exact,gguf-fast,int4-fast",
                        help="our configurations, comma-separated (gguf-exact, gguf-fast, int4-fast; each compiled)")
    parser.add_argument("--tag", default="", help="a word for the table's title (the machine, the load)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    ours = args.ours.split(",")
    unknown = sorted(set(ours) - {"gguf-exact", "gguf-fast", "int4-fast"})
    if unknown or "gguf-fast" not in ours:
        parser.error(f"--ours takes gguf-exact, gguf-fast and int4-fast, gguf-fast among them (the table's ratios are "
                     f"against it); got {args.ours!r}")

    import torch
    from transformers import AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import gguf_path, resolve_model
    from optimum_ipex_spec.utils.import_utils import ipex_status
    from optimum_ipex_spec.utils.timing import timed_generate
    from gguf_llamacpp import bytes_per_token

    status = ipex_status()
    if not status.available:
        print(f"IPEX is not usable here ({status.reason}): run this in the ipex28 lane", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.target)
    target_gguf = str(gguf_path(args.target))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = chat_prompts(tokenizer, n=args.prompts)
    configs, held = [], {}
    for weight_dtype, lowp in (("INT4", "INT8"), ("INT4", "NONE")):
        name = f"IPEX WOQ {weight_dtype.lower()}, {'int8' if lowp == 'INT8' else 'fp32'} compute"
        start = time.perf_counter()
        model = ipex_woq_model(folder, weight_dtype, lowp, args.group_size)
        print(f"{name}: optimized in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        configs.append((name, model))
        gc.collect()
    gguf_bytes = bytes_per_token(target_gguf)
    for mode in ("exact", "fast"):
        if f"gguf-{mode}" in ours:
            model = IPEXModelForCausalLM.from_pretrained(args.target, weights="gguf", gguf_mode=mode,
                                                         torch_compile=True)
            held[f"ours GGUF {mode}"] = gguf_bytes
            configs.append((f"ours GGUF {mode}", model))
    if "int4-fast" in ours:
        int4 = IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int4", gguf_mode="fast",
                                                    torch_compile=True)
        held["ours int4 fast"] = sum(t.numel() * t.element_size() for t in int4.model.buffers())
        configs.append(("ours int4 fast", int4))
    rss = _rss_gb()
    samples = {name: {i: [] for i in range(len(prompts))} for name, _ in configs}
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth.append(measure_bandwidth_gbs())
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            for name, model in configs:
                _, timing = timed_generate(model, inputs, max_new_tokens=args.new_tokens, do_sample=False)
                samples[name][i].append({"decode": timing.decode_tokens_per_s, "ttft": timing.ttft_s})
                print(f"  prompt {i} {name}: {timing.decode_tokens_per_s:.2f} tok/s", file=sys.stderr, flush=True)
    bw = statistics.median(bandwidth)
    base = [statistics.median(s["decode"] for s in by) for by in samples["ours GGUF fast"].values()]
    rows = []
    for name, _ in configs:
        rates = [statistics.median(s["decode"] for s in by) for by in samples[name].values()]
        per_token = held.get(name)
        rows.append({"config": name, "median_decode_tok_s": statistics.median(rates),
                     "ratio_vs_ours_gguf_fast": statistics.median(r / b for r, b in zip(rates, base)),
                     "median_ttft_s": statistics.median(s["ttft"] for by in samples[name].values() for s in by),
                     "weight_gb": per_token / 1e9 if per_token else None,
                     "roofline_tok_s": bw * 1e9 / per_token if per_token else None})
    result = {"date": datetime.date.today().isoformat(), "target": args.target, "threads": args.threads,
              "prompts": len(prompts), "new_tokens": args.new_tokens, "rounds": args.rounds,
              "group_size": args.group_size, "cpu": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "ipex": status.ipex_version, "bandwidth_gbs": bw, "rss_all_models_gb": rss,
              "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    title = f"{args.tag}: " if args.tag else ""
    lines = [f"### {title}{args.target}, {args.threads} thread(s), {len(prompts)} prompts x {args.new_tokens} tokens "
             f"({result['date']}, {result['cpu']}, torch {result['torch']}, IPEX {result['ipex']})", "",
             "| configuration | decode tok/s | vs ours GGUF fast | TTFT s | weights GB | roofline tok/s |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        weight = f"{row['weight_gb']:.2f}" if row["weight_gb"] else "-"
        roof = f"{row['roofline_tok_s']:.1f}" if row["roofline_tok_s"] else "-"
        lines.append(f"| {row['config']} | {row['median_decode_tok_s']:.2f} | x{row['ratio_vs_ours_gguf_fast']:.2f} | "
                     f"{row['median_ttft_s']:.2f} | {weight} | {roof} |")
    lines += ["", f"- Read bandwidth: {bw:.1f} GB/s; weights GB: the bytes a one-token step reads (ours GGUF: the "
                  "file's tensors, the embedding one row; ours int4: its blocks), not reported for IPEX, which keeps "
                  "its quantized weights inside its operators.", ""]
    report = "\n".join(lines)
    with open(args.out, "a") as f:
        f.write(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
