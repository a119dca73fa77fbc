"""`make bench`: decode speed of IPEXModelForCausalLM vs stock transformers on real SmolLM2 and real prompts.

Method (see docs/benchmarks.md): for each dtype, the stock transformers model and ours are loaded
in this one process; every round runs each prompt on both, interleaved (stock, ours, stock, ...),
greedy, ``--new-tokens`` tokens. Per prompt we take the median over rounds of decode tokens/s
(tokens after the first / time between the first and last token) and time to first token; the
ratio is ours / stock per prompt, then the median over prompts. Beside it: the machine's measured
memory bandwidth and the one-token roofline it implies (weights bytes / bandwidth).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.prompts import chat_prompts
from optimum_ipex_spec.provision import resolve_model
from optimum_ipex_spec.utils.import_utils import ipex_status
from optimum_ipex_spec.utils.timing import timed_generate


def measure_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: median of summing a ``size_mb`` fp32 tensor (one read per element)."""
    x = torch.ones(size_mb * 1024 * 1024 // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run_dtype(path, tokenizer, prompts, dtype, args, bar):
    stock = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    wbytes = weight_bytes(stock)
    ours = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=dtype)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    per_prompt = []
    samples = {i: {"stock": [], "ours": []} for i in range(len(prompts))}
    identical = {i: True for i in range(len(prompts))}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            stock_ids, st = timed_generate(stock, inputs, **gen)
            ours_ids, ot = timed_generate(ours, inputs, **gen)
            identical[i] &= torch.equal(stock_ids, ours_ids)
            samples[i]["stock"].append(st)
            samples[i]["ours"].append(ot)
            bar.update(2)
    for i, prompt in enumerate(prompts):
        s, o = samples[i]["stock"], samples[i]["ours"]
        stock_rate = statistics.median(t.decode_tokens_per_s for t in s)
        ours_rate = statistics.median(t.decode_tokens_per_s for t in o)
        per_prompt.append({
            "prompt": i,
            "prompt_tokens": int(tokenizer(prompt, return_tensors="pt").input_ids.shape[1]),
            "stock_decode_tok_s": stock_rate,
            "ours_decode_tok_s": ours_rate,
            "ratio": ours_rate / stock_rate,
            "stock_ttft_s": statistics.median(t.ttft_s for t in s),
            "ours_ttft_s": statistics.median(t.ttft_s for t in o),
            "token_identical": identical[i],
        })
    del stock, ours
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "backend": "ipex" if ipex_status().available else "torch",
        "weight_bytes": wbytes,
        "median_stock_tok_s": statistics.median(p["stock_decode_tok_s"] for p in per_prompt),
        "median_ours_tok_s": statistics.median(p["ours_decode_tok_s"] for p in per_prompt),
        "median_ratio": statistics.median(p["ratio"] for p in per_prompt),
        "prompts": per_prompt,
    }


def run_assisted(path, tokenizer, prompts, args, bar):
    """fp32 target alone (stock and ours) vs ours assisted by its bf16 self-draft, greedy."""
    stock = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    target = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=torch.float32)
    draft = target.self_draft(torch_dtype=torch.bfloat16)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    configs = [("stock fp32 alone", stock, {}), ("ours fp32 alone", target, {})]
    for k in args.draft_tokens:
        configs.append((f"ours fp32 + bf16 self-draft, k={k} constant", target,
                        {"assistant_model": draft, "_k": k, "_schedule": "constant"}))
    configs.append(("ours fp32 + bf16 self-draft, heuristic", target,
                    {"assistant_model": draft, "_k": 8, "_schedule": "heuristic"}))
    samples = {name: {i: [] for i in range(len(prompts))} for name, _, _ in configs}
    identical = {name: True for name, _, _ in configs}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            reference = None
            for name, model, extra in configs:
                extra = dict(extra)
                k, schedule = extra.pop("_k", None), extra.pop("_schedule", None)
                if k is not None:
                    draft.generation_config.num_assistant_tokens = k
                    draft.generation_config.num_assistant_tokens_schedule = schedule
                    draft.generation_config.assistant_confidence_threshold = 0.0
                    draft.last_speculation_stats = None
                out, timing = timed_generate(model, inputs, **gen, **extra)
                stats = draft.last_speculation_stats if k is not None else None
                reference = out if reference is None else reference
                identical[name] &= torch.equal(out, reference)
                samples[name][i].append((timing, stats))
                bar.update(1)
    rows = []
    alone = {i: statistics.median(t.decode_tokens_per_s for t, _ in samples["ours fp32 alone"][i])
             for i in range(len(prompts))}
    alone_total = {i: statistics.median(t.total_s for t, _ in samples["ours fp32 alone"][i])
                   for i in range(len(prompts))}
    for name, _, _ in configs:
        per = samples[name]
        rate = [statistics.median(t.decode_tokens_per_s for t, _ in per[i]) for i in range(len(prompts))]
        e2e = [alone_total[i] / statistics.median(t.total_s for t, _ in per[i]) for i in range(len(prompts))]
        stats = [s for i in range(len(prompts)) for _, s in per[i] if s is not None]
        rows.append({
            "config": name,
            "median_decode_tok_s": statistics.median(rate),
            "median_ratio_vs_ours_alone": statistics.median(r / alone[i] for i, r in enumerate(rate)),
            "median_end_to_end_ratio_vs_ours_alone": statistics.median(e2e),
            "median_ttft_s": statistics.median(t.ttft_s for i in range(len(prompts)) for t, _ in per[i]),
            "acceptance_rate": (sum(s.accepted for s in stats) / sum(s.proposed for s in stats)) if stats else None,
            "mean_tokens_per_target_forward": (statistics.mean(s.mean_accepted_per_round for s in stats)
                                               if stats else None),
            "token_identical_to_target_alone": identical[name],
            "per_prompt": [
                {
                    "prompt": i,
                    "kind": "code" if i % 2 == 0 else "question",
                    "decode_ratio_vs_ours_alone": rate[i] / alone[i],
                    "end_to_end_ratio": e2e[i],
                    "acceptance_rate": _acceptance([s for _, s in per[i] if s is not None]),
                }
                for i in range(len(prompts))
            ],
        })
    return rows


def _acceptance(stats):
    proposed = sum(s.proposed for s in stats)
    return sum(s.accepted for s in stats) / proposed if proposed else None


def run_lookup(path, tokenizer, args, bar):
    """Prompt lookup decoding vs our target alone (fp32, greedy) on grounded real prompts."""
    from optimum_ipex_spec.prompts import lookup_prompts

    model = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=torch.float32)
    prompts = lookup_prompts(tokenizer)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    rows = []
    samples = [{"alone": [], "lookup": [], "stats": [], "same": True} for _ in prompts]
    for _ in range(args.rounds):
        for i, (kind, prompt) in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            alone_ids, alone_t = timed_generate(model, inputs, **gen)
            lookup_ids, lookup_t = timed_generate(model, inputs, prompt_lookup_num_tokens=args.lookup_tokens, **gen)
            samples[i]["same"] &= torch.equal(alone_ids, lookup_ids)
            samples[i]["alone"].append(alone_t)
            samples[i]["lookup"].append(lookup_t)
            samples[i]["stats"].append(model.last_speculation_stats)
            bar.update(2)
    for i, (kind, prompt) in enumerate(prompts):
        s = samples[i]
        alone_total = statistics.median(t.total_s for t in s["alone"])
        lookup_total = statistics.median(t.total_s for t in s["lookup"])
        proposed = sum(st.proposed for st in s["stats"])
        rows.append({
            "prompt": i, "kind": kind, "new_tokens": s["alone"][0].new_tokens,
            "alone_tok_s": statistics.median(t.new_tokens / t.total_s for t in s["alone"]),
            "lookup_tok_s": statistics.median(t.new_tokens / t.total_s for t in s["lookup"]),
            "ratio": alone_total / lookup_total,
            "acceptance_rate": sum(st.accepted for st in s["stats"]) / proposed if proposed else None,
            "token_identical": s["same"],
        })
    return rows


def render_markdown(result) -> str:
    env = result["environment"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{result['command']}` on {result['date']}.",
        "",
        f"Machine: {env['machine']}, {env['threads']} thread(s), torch {env['torch']}, transformers "
        f"{env['transformers']}, IPEX {env['ipex'] or 'not used'}. Model: SmolLM2-135M-Instruct "
        f"({result['model']}), {result['new_tokens']} new tokens, greedy, {result['prompt_count']} real "
        f"prompts (HumanEval code completions and chatterbot-corpus questions), {result['rounds']} rounds, stock and "
        "ours interleaved in one process; medians.",
        "",
        f"Measured read bandwidth: {env['bandwidth_gbs']:.1f} GB/s.",
    ]
    if result["runs"]:
        lines += _decode_tables(result, env)
    lines += _speculation_tables(result)
    return "\n".join(lines)


def _decode_tables(result, env):
    lines = [
        "",
        "## Decode throughput, ours vs stock transformers",
        "",
        "| dtype | stock tok/s | ours tok/s | ratio (median of per-prompt ratios) | one-token roofline tok/s | "
        "output |",
        "|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        roof = env["bandwidth_gbs"] * 1e9 / run["weight_bytes"]
        same = sum(p["token_identical"] for p in run["prompts"])
        lines.append(
            f"| {run['dtype']} | {run['median_stock_tok_s']:.1f} | {run['median_ours_tok_s']:.1f} | "
            f"x{run['median_ratio']:.2f} | {roof:.1f} | token-identical on {same}/{len(run['prompts'])} prompts |"
        )
    lines += ["", "## Per prompt", "",
              "| dtype | prompt | prompt tokens | stock tok/s | ours tok/s | ratio | stock TTFT s | ours TTFT s | "
              "identical |", "|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for p in run["prompts"]:
            lines.append(
                f"| {run['dtype']} | {p['prompt']} | {p['prompt_tokens']} | {p['stock_decode_tok_s']:.1f} | "
                f"{p['ours_decode_tok_s']:.1f} | x{p['ratio']:.2f} | {p['stock_ttft_s']:.2f} | {p['ours_ttft_s']:.2f} | "
                f"{'yes' if p['token_identical'] else 'no'} |"
            )
    return lines


def _speculation_tables(result):
    lines = []
    if result.get("assisted"):
        lines += ["", "## Assisted generation (speculative decoding), fp32 target", "",
                  "Target: SmolLM2 fp32 (ours). Draft: the same checkpoint exported in bf16 "
                  "(`target.self_draft(torch_dtype=torch.bfloat16)`). Greedy; k = draft tokens per round. Decode "
                  "tok/s counts tokens after the first; end-to-end includes prefill (target and draft).", "",
                  "| configuration | decode tok/s | decode ratio vs ours alone | end-to-end ratio | TTFT s | "
                  "acceptance rate | tokens per target forward | output |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in result["assisted"]:
            acc = f"{row['acceptance_rate']:.1%}" if row["acceptance_rate"] is not None else "-"
            mean = f"{row['mean_tokens_per_target_forward']:.2f}" if row["mean_tokens_per_target_forward"] else "-"
            lines.append(
                f"| {row['config']} | {row['median_decode_tok_s']:.1f} | x{row['median_ratio_vs_ours_alone']:.2f} | "
                f"x{row['median_end_to_end_ratio_vs_ours_alone']:.2f} | {row['median_ttft_s']:.2f} | {acc} | {mean} | "
                f"{'identical to target alone' if row['token_identical_to_target_alone'] else 'DIFFERENT'} |"
            )
        lines += ["", "Per prompt (prompts alternate: even = HumanEval code completion, odd = chatterbot question):", "",
                  "| configuration | prompt | kind | decode ratio | end-to-end ratio | acceptance rate |",
                  "|---|---|---|---|---|---|"]
        for row in result["assisted"]:
            if not row["config"].startswith("ours fp32 +"):
                continue
            for p in row["per_prompt"]:
                acc = f"{p['acceptance_rate']:.1%}" if p["acceptance_rate"] is not None else "-"
                lines.append(f"| {row['config']} | {p['prompt']} | {p['kind']} | x{p['decode_ratio_vs_ours_alone']:.2f} | "
                             f"x{p['end_to_end_ratio']:.2f} | {acc} |")
    if result.get("lookup"):
        rows = result["lookup"]
        lines += ["", f"## Prompt lookup decoding (`prompt_lookup_num_tokens={result['lookup_tokens']}`), fp32 target",
                  "", "Ours alone vs ours with adaptive prompt lookup, greedy, end-to-end tokens/s (prefill "
                  "included). Grounded prompts: HumanEval code with an edit instruction, Lee-corpus news "
                  "articles with a restate or summarise instruction.", "",
                  "| prompt | kind | new tokens | alone tok/s | lookup tok/s | ratio | acceptance rate | output |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            acc = f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "-"
            lines.append(f"| {r['prompt']} | {r['kind']} | {r['new_tokens']} | {r['alone_tok_s']:.1f} | "
                         f"{r['lookup_tok_s']:.1f} | x{r['ratio']:.2f} | {acc} | "
                         f"{'identical' if r['token_identical'] else 'DIFFERENT'} |")
        kinds = sorted({r["kind"] for r in rows})
        summary = ", ".join(f"{k} median x{statistics.median(r['ratio'] for r in rows if r['kind'] == k):.2f}"
                            for k in kinds)
        lines += ["", f"Medians by kind: {summary}; slowest prompt x{min(r['ratio'] for r in rows):.2f}."]
    return lines + [
        "",
        "Notes:",
        "- The roofline is weights bytes / measured bandwidth: the most tokens/s any one-token-at-a-time decoder "
        "can reach on this machine. fp32 SmolLM2 is 538 MB of weights.",
        "- bf16 outputs are compared token for token with stock bf16; bf16 rounding differs between IPEX's fused "
        "kernels and stock kernels, so long bf16 continuations may diverge (tests pin a 16-token exact prefix).",
        "- Two shared, noisy cores: only ratios measured in one process are meaningful; absolute tok/s vary run to "
        "run.",
        "",
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Decode benchmark: IPEXModelForCausalLM vs stock transformers.")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="markdown report path")
    parser.add_argument("--json", default=None, help="machine-readable results path")
    parser.add_argument("--no-assisted", action="store_true", help="skip the speculative decoding section")
    parser.add_argument("--draft-tokens", default="4,8,12", help="k values for the constant schedule")
    parser.add_argument("--no-lookup", action="store_true", help="skip the prompt lookup section")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--only", default=None, choices=["decode", "assisted", "lookup"],
                        help="run one section only (the report then holds only that section)")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="only re-render --out from a results file written by --json")
    args = parser.parse_args(argv)
    if args.render:
        report = render_markdown(json.loads(Path(args.render).read_text()))
        Path(args.out).write_text(report) if args.out else print(report)
        return
    args.draft_tokens = [int(k) for k in args.draft_tokens.split(",")]

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tokenizer, n=args.prompts)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    import transformers

    status = ipex_status()
    result = {
        "command": " ".join(["python benchmarks/bench.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "environment": {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "threads": args.threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "ipex": status.ipex_version if status.available else None,
            "bandwidth_gbs": measure_bandwidth_gbs(),
        },
        "runs": [],
    }
    sections = {"decode", "assisted", "lookup"} if args.only is None else {args.only}
    if args.no_assisted:
        sections.discard("assisted")
    if args.no_lookup:
        sections.discard("lookup")
    total = (len(dtypes) * args.rounds * len(prompts) * 2 if "decode" in sections else 0) + (
        args.rounds * len(prompts) * (len(args.draft_tokens) + 3) if "assisted" in sections else 0) + (
        args.rounds * 8 * 2 if "lookup" in sections else 0)
    result["lookup_tokens"] = args.lookup_tokens
    result["prompt_count"] = len(prompts)
    with tqdm(total=total, desc="bench", unit="run") as bar:
        if "decode" in sections:
            for dtype in dtypes:
                result["runs"].append(run_dtype(path, tokenizer, prompts, dtype, args, bar))
        if "assisted" in sections:
            result["assisted"] = run_assisted(path, tokenizer, prompts, args, bar)
        if "lookup" in sections:
            result["lookup"] = run_lookup(path, tokenizer, args, bar)
    if args.only and args.json and Path(args.json).is_file():
        # one section re-measured: keep the other sections of the previous full run
        previous = json.loads(Path(args.json).read_text())
        for key in ("runs", "assisted", "lookup", "lookup_tokens"):
            if not result.get(key) and previous.get(key):
                result[key] = previous[key]
        result["command"] += f"; other sections from {previous.get('date')}: {previous.get('command')}"
    report = render_markdown(result)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
