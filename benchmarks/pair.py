"""`make bench-pair`: a real target with a small draft of its family (issue 14): Qwen2.5-Coder-1.5B + 0.5B.

For each target dtype, one process holds stock transformers' target, our export of it and our export of the
draft; every round runs each prompt through, interleaved: stock alone, ours alone, ours with the draft
(``generate(assistant_model=draft)``, greedy, a constant ``k`` draft tokens per round). Per prompt, the median over
rounds of decode tokens/s (tokens after the first / time from the first to the last token) and time to first token;
ratios per prompt, then the median over prompts. Greedy output is compared token by token with ours alone (and
stock's, in fp32). Memory: the process's RSS after loading everything, and its peak (VmHWM). Beside the plain
rows, the one-token roofline: the target's weight bytes over the read bandwidth measured at the start of every round
(``bench.measure_bandwidth_gbs``, the median over rounds), as in ``make bench``.

Needs ``make provision-qwen``. Usage::

    python benchmarks/pair.py --out docs/benchmarks-qwen-pair.md --json docs/benchmarks-qwen-pair.json
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

from bench import measure_bandwidth_gbs, weight_bytes  # benchmarks/bench.py, beside this file

GB = 1 << 30


def per_prompt_medians(samples: dict, field: str) -> dict:
    """``{configuration: [median over rounds of each timing's `field`, one per prompt]}`` from
    ``samples[configuration][prompt] = [timing per round]``."""
    return {name: [statistics.median(getattr(t, field) for t in rounds) for rounds in by_prompt.values()]
            for name, by_prompt in samples.items()}


def median_ratio(values, baseline) -> float:
    """Median over prompts of ``values[i] / baseline[i]``."""
    return statistics.median(v / b for v, b in zip(values, baseline))


def worst_ratio(values, baseline) -> float:
    """Smallest ``values[i] / baseline[i]`` over prompts."""
    return min(v / b for v, b in zip(values, baseline))


def _rss() -> dict:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024 / GB
    return fields


def run_target_dtype(args, dtype_name, prompts, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.loading.checkpoint import load_causal_lm
    from optimum_ipex_spec.provisioning.provision import resolve_model
    from optimum_ipex_spec.utils.timing import timed_generate

    dtype = getattr(torch, dtype_name)
    draft_dtype = getattr(torch, args.draft_dtype or dtype_name)
    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    start = time.perf_counter()
    ours = IPEXModelForCausalLM.from_pretrained(target_path, export=True, torch_dtype=dtype, **(
        {"backend": "torch", "torch_compile": True} if args.target_torch_compile else {}))
    export_s = time.perf_counter() - start
    gc.collect()
    target_memory = _rss()  # VmHWM: the peak of the target's load (and compile: Inductor's packing passes)
    if args.draft_weights == "int8":  # weight-only int8 on our pure-PyTorch decoder, bf16 activations, loaded as
        # self_draft(weights="int8") loads it: the fp32 checkpoint converted to bf16 without holding both
        draft = IPEXModelForCausalLM.from_transformers_model(
            load_causal_lm(draft_path, torch.bfloat16), dtype=torch.bfloat16,
            backend="torch", weights="int8", torch_compile=args.draft_torch_compile, source=draft_path)
        draft_dtype = "int8 weights"
    else:
        draft = IPEXModelForCausalLM.from_pretrained(draft_path, export=True, torch_dtype=draft_dtype,
                                                     **({"torch_compile": True} if args.draft_torch_compile else {}))
    for model in (ours, draft):  # a compiled step's chunk graph (a draft's catch-up, a bf16 target's verification)
        model.compile_chunk_step()  # compiled at load, not inside the first timed call
    draft.generation_config.num_assistant_tokens = args.k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    gc.collect()
    ours_memory = _rss()
    stock = AutoModelForCausalLM.from_pretrained(target_path, torch_dtype=dtype).eval() if not args.no_stock else None
    configs = [("stock alone", stock, {}), ("ours alone", ours, {}),
               (f"ours + draft, k={args.k}", ours, {"assistant_model": draft,
                                                    "num_assistant_tokens_schedule": "constant"}),
               (f"ours + draft, cost model (default, k <= {args.cost_max_tokens})", ours,
                {"assistant_model": draft, "num_assistant_tokens_schedule": "cost", "_k": args.cost_max_tokens})]
    configs = [c for c in configs if c[1] is not None]
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    samples = {name: {i: [] for i in range(len(prompts))} for name, _, _ in configs}
    identical = {name: True for name, _, _ in configs}
    accepted = proposed = 0
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth.append(measure_bandwidth_gbs())
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            outputs = {}
            for name, model, extra in configs:
                draft.last_speculation_stats = None
                extra = dict(extra)  # the draft's num_assistant_tokens: the constant k, or the cost model's cap
                draft.generation_config.num_assistant_tokens = extra.pop("_k", args.k)
                outputs[name], timing = timed_generate(model, inputs, **gen, **extra)
                samples[name][i].append(timing)
                stats = draft.last_speculation_stats if extra else None
                if stats is not None:
                    accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
                print(f"  {dtype_name} prompt {i} {name}: {timing.decode_tokens_per_s:.2f} tok/s", file=sys.stderr,
                      flush=True)
            for name in outputs:
                identical[name] &= torch.equal(outputs[name], outputs["ours alone"])
    rate = per_prompt_medians(samples, "decode_tokens_per_s")
    rows = []
    for name, _, _ in configs:
        rows.append({
            "config": name,
            "median_decode_tok_s": statistics.median(rate[name]),
            "ratio_vs_ours_alone": median_ratio(rate[name], rate["ours alone"]),
            "ratio_vs_stock": median_ratio(rate[name], rate["stock alone"]) if "stock alone" in rate else None,
            "worst_ratio_vs_ours_alone": worst_ratio(rate[name], rate["ours alone"]),
            "median_ttft_s": statistics.median(t.ttft_s for i in samples[name] for t in samples[name][i]),
            "identical_to_ours_alone": identical[name],
        })
    target_bytes = weight_bytes(stock) if stock is not None else None
    bandwidth_gbs = statistics.median(bandwidth)
    result = {
        "target_dtype": dtype_name, "draft_dtype": str(draft_dtype).replace("torch.", ""), "k": args.k,
        "export_s": export_s, "rss_ours_gb": ours_memory["VmRSS"], "peak_rss_gb": _rss()["VmHWM"], "rows": rows,
        "rss_target_gb": target_memory["VmRSS"], "peak_rss_target_load_gb": target_memory["VmHWM"],
        "target_torch_compile": args.target_torch_compile, "draft_torch_compile": args.draft_torch_compile,
        "acceptance_rate": accepted / proposed if proposed else None,
        "target_weight_gb": target_bytes / GB if target_bytes else None,
        "bandwidth_gbs": bandwidth_gbs, "bandwidth_gbs_by_round": bandwidth,
        "roofline_tok_s": bandwidth_gbs * 1e9 / target_bytes if target_bytes else None,
    }
    del stock, ours, draft, configs
    gc.collect()
    return result


def _setup_line(run) -> str:
    target = "compiled (`torch_compile=True`, pure-PyTorch path)" if run.get("target_torch_compile") else "exported"
    draft = ", compiled" if run.get("draft_torch_compile") else ""
    return f"{run['target_dtype']} target: ours {target}; draft {run['draft_dtype']}{draft}."


def render(result) -> str:
    lines = [
        "# Benchmarks: Qwen2.5-Coder-1.5B target + 0.5B draft",
        "",
        f"Generated by `{result['command']}` on {result['date']}: {result['threads']} thread(s), "
        f"{result['new_tokens']} new tokens, greedy, {result['prompt_count']} real prompts (HumanEval code and "
        f"chatterbot questions, chat template), {result['rounds']} rounds interleaved in one process; medians. "
        f"torch {result['torch']}, transformers {result['transformers']}, IPEX {result['ipex']}.",
        "",
        *[_setup_line(run) for run in result["runs"]],
        "",
        "| target | draft | configuration | decode tok/s | vs ours alone (worst prompt) | vs stock | share of the one-token "
        "roofline | TTFT s | output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        for row in run["rows"]:
            vs_stock = f"x{row['ratio_vs_stock']:.2f}" if row["ratio_vs_stock"] else "-"
            roof = run.get("roofline_tok_s")
            share = f"{row['median_decode_tok_s'] / roof:.0%}" if roof and "draft" not in row["config"] else "-"
            lines.append(
                f"| {run['target_dtype']} | {run['draft_dtype'] if 'draft' in row['config'] else '-'} | "
                f"{row['config']} | {row['median_decode_tok_s']:.2f} | x{row['ratio_vs_ours_alone']:.2f} "
                f"(x{row['worst_ratio_vs_ours_alone']:.2f}) | {vs_stock} | {share} | {row['median_ttft_s']:.2f} | "
                f"{'identical' if row['identical_to_ours_alone'] else 'DIFFERENT'} |")
    lines += ["", "| target dtype | export s (target) | acceptance rate | process RSS after loading ours: target / target + "
              "draft GB | process peak RSS: after the target's load / so far GB |", "|---|---|---|---|---|"]
    for run in result["runs"]:
        acceptance = f"{run['acceptance_rate']:.1%}" if run["acceptance_rate"] is not None else "-"
        peak = f"{run['peak_rss_gb']:.2f}" if run.get("peak_rss_gb") is not None else "-"
        target = f"{run['rss_target_gb']:.2f} / " if run.get("rss_target_gb") is not None else ""
        target_peak = f"{run['peak_rss_target_load_gb']:.2f} / " if run.get("peak_rss_target_load_gb") is not None else ""
        lines.append(f"| {run['target_dtype']} | {run['export_s']:.0f} | {acceptance} | {target}{run['rss_ours_gb']:.2f} "
                     f"| {target_peak}{peak} |")
    for run in result["runs"]:
        if run.get("roofline_tok_s"):
            lines.append("")
            lines.append(
                f"{run['target_dtype']}: read bandwidth {run['bandwidth_gbs']:.1f} GB/s (median of "
                + ", ".join(f"{b:.1f}" for b in run["bandwidth_gbs_by_round"])
                + f", one per round), target weights {run['target_weight_gb']:.2f} GB, one-token roofline "
                f"{run['roofline_tok_s']:.2f} tok/s: the most any decoder reading every weight once per token reaches "
                "here (the input embedding's table, of which a step reads one row, is counted, so the true bound is "
                "somewhat higher). Only speculation, which reads the weights once for several tokens, can pass it.")
    lines += ["", "RSS after loading counts only the pages read so far: an fp32 target is the memory-mapped checkpoint, "
              "read during generation (a compiled fp32 target on AVX-512 holds its weights once, the packed kernel's copy, "
              "shared by its two graphs and read by the prefill, which replaced the model's own, both side by side while "
              "packing: the peak after the target's load; a compiled bf16 target holds the packed copy beside the "
              "model's; without the packed kernel Inductor's graphs keep a copy each). The peak (VmHWM) is the process's, stock transformers' target included "
              "unless `--no-stock`; in the second section it includes the first's."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="target dtypes")
    parser.add_argument("--draft-dtype", default="bfloat16",
                        help="the draft's dtype (bf16, the fastest draft here, for both targets)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (constant schedule)")
    parser.add_argument("--cost-max-tokens", type=int, default=8,
                        help="the cost model's longest round (the draft's num_assistant_tokens; self_draft() sets 8)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-stock", action="store_true", help="skip stock transformers (saves its memory)")
    parser.add_argument("--draft-torch-compile", action="store_true",
                        help="the draft on the pure-PyTorch path with its one-token step compiled (bf16 or int8 draft)")
    parser.add_argument("--target-torch-compile", action="store_true",
                        help="the target on the pure-PyTorch path with its decode/verification step compiled")
    parser.add_argument("--draft-weights", default="dense", choices=["dense", "int8"],
                        help="int8: the draft as weight-only int8 (bf16 activations) on our pure-PyTorch decoder")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import resolve_model
    from optimum_ipex_spec.utils.import_utils import ipex_status

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    prompts = chat_prompts(tokenizer, n=args.prompts)
    status = ipex_status()
    result = {
        "command": " ".join(["python benchmarks/pair.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(), "threads": args.threads, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "prompt_count": len(prompts), "torch": torch.__version__,
        "transformers": transformers.__version__, "ipex": status.ipex_version if status.available else None,
        "runs": [run_target_dtype(args, d, prompts, tokenizer) for d in args.dtypes.split(",")],
    }
    report = render(result)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
