"""`make bench-compile`: the pure-PyTorch path with ``torch_compile=True`` (issue 16), SmolLM2-135M, torch-current lane.

One process holds, per dtype, stock transformers (its default dynamic cache, and ``cache_implementation="static"``),
our eager decoder and our compiled one (its 1-token graph); in fp32 also the compiled target (its 4-token graph compiled
ahead) with a compiled bf16 self-draft (``self_draft(torch_compile=True)``) and a compiled int8 self-draft
(``self_draft(weights="int8", torch_compile=True)``). Every round runs each prompt through every configuration,
interleaved; per prompt the median over rounds of decode tokens/s and time to first token, ratios per prompt, then the
median over prompts. Output is compared token by token with stock of the same dtype. Memory: the process's RSS growth
while loading each model (and its compile), and the peak (VmHWM) at the end.

Usage::

    python benchmarks/compiled_step.py --out docs/benchmarks-torch-compile.md --json docs/benchmarks-torch-compile.json
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

from pair import GB, _rss, median_ratio, per_prompt_medians, worst_ratio


def _load(what, build):
    """(model, RSS growth GB, seconds) of ``build()``."""
    gc.collect()
    before, start = _rss()["VmRSS"], time.perf_counter()
    model = build()
    seconds = time.perf_counter() - start
    gc.collect()
    print(f"  loaded {what}: {seconds:.1f} s, +{_rss()['VmRSS'] - before:.2f} GB", file=sys.stderr, flush=True)
    return model, _rss()["VmRSS"] - before, seconds


def run_dtype(args, dtype_name, path, prompts, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.utils.import_utils import ipex_dtype_unsupported, ipex_status
    from optimum_ipex_spec.utils.timing import timed_generate

    dtype = getattr(torch, dtype_name)
    stock, stock_gb, stock_s = _load("stock", lambda: AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval())
    weight_gb = sum(p.numel() * p.element_size() for p in stock.parameters()) / GB
    loads = {"stock": (stock_gb, stock_s)}
    configs = [("stock", stock, {}), ("stock, static cache", stock, {"cache_implementation": "static"})]
    ours, *loads["ours eager"] = _load("ours", lambda: IPEXModelForCausalLM.from_pretrained(
        path, export=True, torch_dtype=dtype, backend="torch"))
    configs.append(("ours eager", ours, {}))
    # single tokens run on a graph of their own (before torch 2.13 fp32 ones run padded on the 4-token graph)
    compiled, *loads["ours compiled"] = _load("ours compiled", lambda: IPEXModelForCausalLM.from_pretrained(
        path, export=True, torch_dtype=dtype, backend="torch", torch_compile=True))
    configs.append(("ours compiled", compiled, {}))
    if ipex_status().available and not ipex_dtype_unsupported(dtype_name):  # a lane with IPEX: its graphs beside
        graphs, *loads["ours IPEX graphs"] = _load("ours IPEX graphs", lambda: IPEXModelForCausalLM.from_pretrained(
            path, export=True, torch_dtype=dtype, backend="ipex"))
        configs.append(("ours IPEX graphs", graphs, {}))
    # the target's 4-token verification graph, compiled ahead (not inside the first timed round; in bf16 for its
    # memory only: nothing below verifies on a bf16 target); where single fp32 tokens run padded on it (torch < 2.13)
    # it compiled at load and this is instant
    _, chunk_gb, chunk_s = _load(f"{dtype_name} verification graph", compiled.compile_chunk_step)
    step = compiled.runner.step
    chunk_graph = {"load_s": chunk_s, "load_rss_gb": chunk_gb, "step_rows": step.step_rows,
                   "chunk_exact": step.chunk_exact, "kernel": step.kernel}
    if dtype == torch.float32:
        cdraft, *loads["bf16 self-draft, compiled"] = _load("compiled draft", lambda: compiled.self_draft(
            backend="torch", torch_compile=True))
        idraft, *loads["int8 self-draft, compiled"] = _load("compiled int8 draft", lambda: compiled.self_draft(
            weights="int8", torch_compile=True))
        configs += [("ours compiled + bf16 self-draft, compiled", compiled, {"assistant_model": cdraft}),
                    ("ours compiled + int8 self-draft, compiled", compiled, {"assistant_model": idraft})]
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    samples = {name: {i: [] for i in range(len(prompts))} for name, _, _ in configs}
    identical = {name: [True] * len(prompts) for name, _, _ in configs}
    views = {name: [None] * len(prompts) for name, _, extra in configs if "assistant_model" in extra}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            outputs = {}
            for name, model, extra in configs:
                outputs[name], timing = timed_generate(model, inputs, **gen, **extra)
                samples[name][i].append(timing)
                identical[name][i] &= torch.equal(outputs[name], outputs["stock"])
                if name in views and model.last_cost_model is not None:  # the last round's view of this prompt
                    views[name][i] = model.last_cost_model.report()
                print(f"  {dtype_name} prompt {i} {name}: {timing.decode_tokens_per_s:.1f} tok/s, "
                      f"TTFT {timing.ttft_s:.2f} s", file=sys.stderr, flush=True)
    rate = per_prompt_medians(samples, "decode_tokens_per_s")
    ttft = per_prompt_medians(samples, "ttft_s")
    rows = []
    for name, _, _ in configs:
        rows.append({
            "config": name,
            "median_decode_tok_s": statistics.median(rate[name]),
            "ratio_vs_stock": median_ratio(rate[name], rate["stock"]),
            "ratio_vs_stock_static": median_ratio(rate[name], rate["stock, static cache"]),
            "ratio_vs_ours_eager": median_ratio(rate[name], rate["ours eager"]),
            "worst_ratio_vs_ours_eager": worst_ratio(rate[name], rate["ours eager"]),
            "ratio_vs_ours_compiled": median_ratio(rate[name], rate["ours compiled"]),
            "worst_ratio_vs_ours_compiled": worst_ratio(rate[name], rate["ours compiled"]),
            "median_ttft_s": statistics.median(ttft[name]),
            "ttft_vs_stock": median_ratio(ttft[name], ttft["stock"]),
            "identical_prompts": sum(identical[name]),
            "load_rss_gb": loads[name][0] if name in loads else None,
            "load_s": loads[name][1] if name in loads else None,
            "cost_model_by_prompt": views.get(name),
        })
    # the drafts' loads are their own rows' extra memory
    for name in ("bf16 self-draft, compiled", "int8 self-draft, compiled"):
        for row in rows:
            if row["config"].endswith(name):
                row["load_rss_gb"], row["load_s"] = loads[name]
    result = {"dtype": dtype_name, "weight_gb": weight_gb, "rows": rows, "chunk_graph": chunk_graph}
    del stock, ours, compiled, configs
    gc.collect()
    return result


def _cpu() -> str:
    """This CPU's model name and the ISA PyTorch dispatches to (figures differ between machines), from one read of
    /proc/cpuinfo."""
    import torch

    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    amx = " with AMX" if capability == "AVX512" and "amx_bf16" in flags else ""
    return f"{name}, {capability}{amx}"


def render(result) -> str:
    lines = [
        "# Benchmarks: the pure-PyTorch path compiled (`torch_compile=True`)",
        "",
        f"Generated by `{result['command']}` on {result['date']}: SmolLM2-135M-Instruct, {result['threads']} thread(s), "
        f"{result['new_tokens']} new tokens, greedy, {result['prompt_count']} real prompts (HumanEval code and "
        f"chatterbot questions, chat template), {result['rounds']} rounds interleaved in one process; medians of "
        f"per-prompt ratios. torch {result['torch']}, transformers {result['transformers']}, "
        + (f"IPEX {result['ipex']} (its graphs, the default export there: `ours IPEX graphs`)" if result.get("ipex")
           else "no IPEX") + ". Peak RSS of the "
        f"process: {result['peak_rss_gb']:.2f} GiB"
        + (f"; before any model, a trivial `torch.compile` loaded Inductor itself (+{result['compiler_rss_gb']:.2f} GiB "
           "of RSS, once per process, in no row's figure)." if result.get("compiler_rss_gb") is not None else "."),
        "",
        "| dtype | configuration | decode tok/s | vs stock | vs stock static cache | vs ours eager (worst) "
        "| vs ours compiled (worst) | TTFT s | TTFT vs stock | identical to stock | load s "
        "| RSS added by loading GiB (weights GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        for row in run["rows"]:
            load = "-" if row["load_s"] is None else f"{row['load_s']:.0f}"
            rss = "-" if row["load_rss_gb"] is None else f"{row['load_rss_gb']:.2f} ({run['weight_gb']:.2f})"
            lines.append(
                f"| {run['dtype']} | {row['config']} | {row['median_decode_tok_s']:.1f} | x{row['ratio_vs_stock']:.2f} "
                f"| x{row['ratio_vs_stock_static']:.2f} | x{row['ratio_vs_ours_eager']:.2f} "
                f"(x{row['worst_ratio_vs_ours_eager']:.2f}) | x{row['ratio_vs_ours_compiled']:.2f} "
                f"(x{row['worst_ratio_vs_ours_compiled']:.2f}) | {row['median_ttft_s']:.2f} | x{row['ttft_vs_stock']:.2f} "
                f"| {row['identical_prompts']}/{result['prompt_count']} | {load} | {rss} |")
    views = [(run["dtype"], row) for run in result["runs"] for row in run["rows"] if row.get("cost_model_by_prompt")]
    if views:
        lines += ["", "The cost model's view of each draft row, per prompt (last round; `target.last_cost_model.report()`): "
                  "draft ms per token, one-token decode ms (`-`: never run), verification ms by chunk length, "
                  "chosen draft lengths and rounds without the draft.", "",
                  "| dtype | configuration | prompt | draft ms/token | decode ms | verify ms by k | chosen k: rounds | "
                  "rounds off / rounds |", "|---|---|---|---|---|---|---|---|"]
        for dtype, row in views:
            for i, view in enumerate(row["cost_model_by_prompt"]):
                if view is None:
                    continue
                verify = ", ".join(f"{k}: {ms:.0f}" for k, ms in view["verify_ms_by_n"].items())
                chosen = ", ".join(f"{k}: {n}" for k, n in view["chosen_k"].items())
                decode = "-" if view["decode_ms"] is None else f"{view['decode_ms']:.1f}"
                draft = "-" if view["draft_ms_per_token"] is None else f"{view['draft_ms_per_token']:.1f}"
                lines.append(f"| {dtype} | {row['config']} | {i} | {draft} | {decode} | {verify} | {chosen} | "
                             f"{view['rounds_off']} / {view['rounds']} |")
    lines += [
        "",
        "Notes:",
        "- `ours compiled` loads in the time Inductor takes to compile its graphs (freezing, max-autotune over its C++ "
        "GEMM templates; on AVX-512, optimum_ipex_spec.kernels.packed_gemm's kernel instead, fp32 and, with "
        "AVX512-BF16, bf16; "
        "from torch 2.13 under Inductor's C++ wrapper, whose C++ the first compile of a model's shapes builds, then "
        "cached): "
        "a 1-token graph (plain decoding); a target compiles its 4-token verification graph at its first chunk of "
        "draft tokens, or ahead with `compile_chunk_step()`, which holds a second packed copy of its weights where "
        "Inductor's GEMMs run (the packed kernel's graphs share one; in fp32 it replaces the model's own weights, "
        "which the prefill then multiplies with too: each weight held once). In fp32 that graph is checked at its compile to give each token the bits the 1-token "
        "graph gives it, so a decoded and a verified token compute the same logits (where the autotuner also offers "
        "ATen's kernels, before torch 2.13, a single token runs padded on the 4-token graph instead). The prefill "
        "stays on the eager decoder.",
        "- The self-draft rows are the compiled fp32 target with "
        "`self_draft(backend='torch', torch_compile=True)` or `self_draft(weights='int8', torch_compile=True)` as "
        "`assistant_model` (cost model schedule); their RSS column is the draft's load. RSS growth is measured "
        "in one process: memory freed by an earlier model is reused, so the fp32 section's figures understate.",
        "- bf16 outputs are compared with stock bf16; kernels round differently, so long bf16 continuations may "
        "diverge. fp32 outputs (target alone, and with either draft) must be identical.",
    ]
    for run in result["runs"]:
        chunk = run.get("chunk_graph")
        if chunk:
            lines.append(
                f"- The {run['dtype']} target's verification graph, compiled ahead (before the timed rounds): "
                f"{chunk['load_s']:.0f} s, {chunk['load_rss_gb']:+.2f} GiB of RSS; single tokens run on "
                + ("a 1-token graph of their own" if chunk["step_rows"] == 1
                   else f"it, padded to {chunk['step_rows']} rows")
                + (" (it rounds otherwise: chunks ran one token per call)" if chunk["chunk_exact"] is False else "")
                + {"packed": "; both graphs' products run optimum_ipex_spec.kernels.packed_gemm's "
                              f"{run['dtype']} kernel, on one packed copy of the weights",
                   "inductor": "; its products run Inductor's GEMM templates"}.get(chunk.get("kernel"), "") + ".")
    if result.get("cpu"):
        lines.append(f"- CPU: {result['cpu']}.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description="The pure-PyTorch path compiled vs eager vs stock transformers.")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
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
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tokenizer, n=args.prompts)
    # Inductor's own code (and its C++ toolchain's first build) loads at the first compile of the process: measured
    # apart, with a trivial compile, so that each row's RSS is its model's
    before = _rss()["VmRSS"]
    torch.compile(lambda x: x * 2 + 1)(torch.ones(8))
    compiler_gb = _rss()["VmRSS"] - before
    result = {
        "compiler_rss_gb": compiler_gb,
        "command": " ".join(["python benchmarks/compiled_step.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(), "threads": args.threads, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "prompt_count": len(prompts), "torch": torch.__version__,
        "transformers": transformers.__version__, "ipex": ipex_status().ipex_version, "cpu": _cpu(),
        "runs": [run_dtype(args, d, path, prompts, tokenizer) for d in args.dtypes.split(",")],
    }
    result["peak_rss_gb"] = _rss()["VmHWM"]
    report = render(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.out:
        Path(args.out).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
