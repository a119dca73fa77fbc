"""`make bench`: decode speed of IPEXModelForCausalLM vs stock transformers on real SmolLM2 and real prompts.

Method (see docs/benchmarks.md): for each dtype, the stock transformers model and ours are loaded
in this one process; every round runs each prompt on both, interleaved (stock, ours, stock, ...),
greedy, ``--new-tokens`` tokens. Per prompt we take the median over rounds of decode tokens/s
(tokens after the first / time between the first and last token) and time to first token; the
ratio is ours / stock per prompt, then the median over prompts. Beside it: the machine's measured
memory bandwidth and the one-token roofline it implies (weights bytes / bandwidth).

The markdown report embeds two PNG plots (see plots.py) written next to it. ``--render JSON`` rebuilds
the report and the plots from a results file without measuring anything (nor importing torch):

    python benchmarks/bench.py --render docs/benchmarks.json --out docs/benchmarks.md
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plots import image_lines, render_plots  # noqa: E402  (benchmarks/plots.py; imports matplotlib lazily)


def _heavy_imports():
    """torch, transformers and the package: needed to measure, not to --render."""
    global torch, AutoModelForCausalLM, AutoTokenizer, IPEXModelForCausalLM, chat_prompts, resolve_model
    global ipex_status, timed_generate
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import resolve_model
    from optimum_ipex_spec.utils.import_utils import ipex_status
    from optimum_ipex_spec.utils.timing import timed_generate


def measure_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: median of summing a ``size_mb`` fp32 tensor (one read per element)."""
    import torch

    x = torch.ones(size_mb * 1024 * 1024 // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(model) -> int:
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
    step_rows = getattr(ours.runner, "step_rows", 1)  # the IPEX runner's padded one-token step, chosen at warm-up
    del stock, ours
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "step_rows": step_rows,
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
    configs.append(("ours fp32 + bf16 self-draft, cost model (default)", target,
                    {"assistant_model": draft, "_k": 8, "_schedule": "cost"}))
    configs.append(("ours fp32 + bf16 self-draft, cost model, draft's own cache", target,  # share_target_kv=False
                    {"assistant_model": draft, "_k": 8, "_schedule": "cost", "_share": False}))
    configs.append(("ours fp32 + int8 self-draft, cost model", target,  # self_draft(weights="int8")
                    {"assistant_model": target.self_draft(weights="int8"), "_k": 8, "_schedule": "cost"}))
    samples = {name: {i: [] for i in range(len(prompts))} for name, _, _ in configs}
    identical = {name: True for name, _, _ in configs}
    views = {}  # the cost model's report of every run of a "cost" row
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            reference = None
            for name, model, extra in configs:
                extra = dict(extra)
                k, schedule = extra.pop("_k", None), extra.pop("_schedule", None)
                assistant = extra.get("assistant_model")
                if assistant is not None:  # the KV cache shared with the target (shared_kv.py) unless a row says not
                    assistant.share_target_kv = extra.pop("_share", True)
                if k is not None:
                    assistant.generation_config.num_assistant_tokens = k
                    assistant.generation_config.num_assistant_tokens_schedule = schedule
                    assistant.generation_config.assistant_confidence_threshold = 0.0
                    assistant.last_speculation_stats = None
                    extra["num_assistant_tokens_schedule"] = schedule  # passed: "constant" means constant
                out, timing = timed_generate(model, inputs, **gen, **extra)
                if schedule == "cost" and target.last_cost_model is not None:
                    views.setdefault(name, []).append(target.last_cost_model.report())
                stats = assistant.last_speculation_stats if k is not None else None
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
        k, schedule = next(((e.get("_k"), e.get("_schedule")) for n, _, e in configs if n == name), (None, None))
        rows.append({
            "config": name,
            "k": k,
            "schedule": schedule,
            "median_decode_tok_s": statistics.median(rate),
            "median_ratio_vs_ours_alone": statistics.median(r / alone[i] for i, r in enumerate(rate)),
            "median_end_to_end_ratio_vs_ours_alone": statistics.median(e2e),
            "median_ttft_s": statistics.median(t.ttft_s for i in range(len(prompts)) for t, _ in per[i]),
            "acceptance_rate": (sum(s.accepted for s in stats) / sum(s.proposed for s in stats)) if stats else None,
            "mean_tokens_per_target_forward": (statistics.mean(s.mean_accepted_per_round for s in stats)
                                               if stats else None),
            "token_identical_to_target_alone": identical[name],
            "draft_forward_tokens_per_call": statistics.mean(s.draft_forward_tokens for s in stats) if stats else None,
            "shared_rows_per_call": statistics.mean(s.shared_rows for s in stats) if stats else None,
            **({"cost_model": _cost_model_view(views[name])} if name in views else {}),
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


def _cost_model_view(reports):
    """The cost model's view over a row's runs (``CostModel.report()`` of each): medians of its measurements, the
    share of rounds it spent without drafting and its most chosen draft lengths."""
    def median_of(key):
        values = [r[key] for r in reports if r.get(key) is not None]
        return statistics.median(values) if values else None

    chosen = {}
    for report in reports:
        for k, count in report["chosen_k"].items():
            chosen[int(k)] = chosen.get(int(k), 0) + count
    rounds = sum(r["rounds"] for r in reports)
    return {
        "decode_ms": median_of("decode_ms"),
        "draft_ms_per_token": median_of("draft_ms_per_token"),
        "alpha": median_of("alpha"),
        "rounds_off_share": sum(r["rounds_off"] for r in reports) / rounds if rounds else None,
        "probes": sum(r["probes"] for r in reports),
        "top_k": sorted(chosen, key=lambda k: -chosen[k])[:3],
        "runs": len(reports),
    }


def _tokens_per_forward(stats):
    """Tokens emitted per verifying target forward (accepted proposals + the target's own token), over the
    rounds that proposed something; None when nothing was proposed."""
    rounds = sum(s.rounds for s in stats)
    return (sum(s.accepted for s in stats) + rounds) / rounds if rounds else None


def _acceptance(stats):
    proposed = sum(s.proposed for s in stats)
    return sum(s.accepted for s in stats) / proposed if proposed else None


def run_lookup(path, tokenizer, args, bar):
    """Prompt lookup decoding vs our target alone (fp32, greedy) on grounded real prompts."""
    from optimum_ipex_spec.provisioning.prompts import lookup_prompts

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
            samples[i]["stats_cost"] = model.last_cost_model is not None
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
            "mean_tokens_per_target_forward": _tokens_per_forward(s["stats"]),
            "alone_ttft_s": statistics.median(t.ttft_s for t in s["alone"]),
            "lookup_ttft_s": statistics.median(t.ttft_s for t in s["lookup"]),
            "token_identical": s["same"],
            "schedule": "cost" if s["stats_cost"] else "back-off",
        })
    return rows


#: result keys of the report's sections (decode: "runs"), in report order
_SECTION_KEYS = ("runs", "assisted", "lookup", "universal")


def _own_command(result) -> str:
    """``result``'s command without the previous runs that results written before 2026-12-03 appended to it."""
    return result.get("command", "").split("; other sections from")[0]


def _provenance_line(result) -> str:
    """'Generated by ...': one command and date, or, after ``--only`` runs merged into a previous result, which
    command measured which section when."""
    sections = result.get("sections") or {}
    runs = {}
    for key in _SECTION_KEYS:
        if key in sections:
            runs.setdefault((sections[key]["command"], sections[key]["date"]), []).append(
                "decode" if key == "runs" else key)
    if not runs:  # written before 2026-12-03: its command names the earlier runs it merged
        return f"Generated by `{result['command']}` on {result['date']}."
    if len(runs) == 1:
        (command, date), = runs
        return f"Generated by `{command}` on {date}."
    return "Generated section by section: " + "; ".join(
        f"{', '.join(keys)} by `{command}` on {date}" for (command, date), keys in runs.items()) + "."


def run_universal(args, bar):
    """Universal assisted generation: Gemma 3 270M target (ours) + SmolLM2-135M draft (ours), different
    tokenizers, greedy, vs the Gemma 3 target alone. Acceptance is counted by wrapping transformers'
    candidate generator for the duration of the section (measurement only)."""
    from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers as UAG

    from optimum_ipex_spec.provisioning.prompts import chatterbot_questions, humaneval_prompts, news_articles

    target_path, draft_path = resolve_model("gemma3-270m"), resolve_model("smollm2-135m-instruct")
    target_tok, draft_tok = AutoTokenizer.from_pretrained(target_path), AutoTokenizer.from_pretrained(draft_path)
    target = IPEXModelForCausalLM.from_pretrained(target_path, export=True, torch_dtype=torch.float32)
    draft = IPEXModelForCausalLM.from_pretrained(draft_path, export=True, torch_dtype=torch.float32)
    prompts = [("code", humaneval_prompts((2,))[0]), ("news", news_articles((1,), max_words=60)[0] + "\n\nIn short,"),
               ("question", f"Question: {chatterbot_questions()[0]}\nAnswer:")]
    counts = {"proposed": 0, "accepted": 0, "rounds": 0}
    original_get, original_update = UAG.get_candidates, UAG.update_candidate_strategy

    def get_candidates(self, input_ids):
        candidates, logits = original_get(self, input_ids)
        counts["proposed"] += candidates.shape[1] - input_ids.shape[1]
        return candidates, logits

    def update(self, input_ids, scores, num_matches):
        counts["accepted"] += int(num_matches)
        counts["rounds"] += 1
        return original_update(self, input_ids, scores, num_matches)

    new_tokens = min(args.new_tokens, 64)  # Gemma 3 on 4.x: prompt + new tokens stay inside its 512-token window
    rows = []
    UAG.get_candidates, UAG.update_candidate_strategy = get_candidates, update
    try:
        for kind, text in prompts:
            inputs = target_tok(text, return_tensors="pt")
            alone, with_draft, same = [], [], True
            counts.update(proposed=0, accepted=0, rounds=0)
            for _ in range(args.rounds):
                ref, t_alone = timed_generate(target, inputs, max_new_tokens=new_tokens, do_sample=False)
                out, t_uag = timed_generate(target, inputs, max_new_tokens=new_tokens, do_sample=False,
                                            assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok)
                same &= torch.equal(ref, out)
                alone.append(t_alone)
                with_draft.append(t_uag)
                bar.update(2)
            rows.append({
                "kind": kind, "new_tokens": alone[0].new_tokens,
                "alone_tok_s": statistics.median(t.new_tokens / t.total_s for t in alone),
                "universal_tok_s": statistics.median(t.new_tokens / t.total_s for t in with_draft),
                "ratio": statistics.median(t.total_s for t in alone) / statistics.median(t.total_s for t in with_draft),
                "acceptance_rate": counts["accepted"] / counts["proposed"] if counts["proposed"] else None,
                "mean_tokens_per_target_forward": ((counts["accepted"] + counts["rounds"]) / counts["rounds"]
                                                   if counts["rounds"] else None),
                "token_identical": same,
            })
    finally:
        UAG.get_candidates, UAG.update_candidate_strategy = original_get, original_update
    return {"target": "gemma3-270m", "target_backend": target.backend, "draft": "smollm2-135m-instruct",
            "draft_backend": draft.backend, "rows": rows}


def render_markdown(result, plots=None) -> str:
    """The report for ``result``; ``plots`` ({kind: path} from plots.render_plots) are embedded by file name."""
    plots = plots or {}
    env = result["environment"]
    lines = [
        "# Benchmarks",
        "",
        _provenance_line(result),
        "",
        f"Machine: {env['machine']}, {env['threads']} thread(s), torch {env['torch']}, transformers "
        f"{env['transformers']}, IPEX {env['ipex'] or 'not used'}. Model: SmolLM2-135M-Instruct "
        f"({result['model']}), {result['new_tokens']} new tokens, greedy, {result['prompt_count']} real "
        f"prompts (HumanEval code completions and chatterbot-corpus questions), {result['rounds']} rounds, stock and "
        "ours interleaved in one process; medians.",
        "",
        f"Measured read bandwidth: {_decode_bandwidth(env):.1f} GB/s"
        + (f" (with the decode section); one-token roofline (weights bytes / bandwidth): "
           + ", ".join(f"{r['dtype']} {_decode_bandwidth(env) * 1e9 / r['weight_bytes']:.1f} tok/s"
                       for r in result["runs"]) if result.get("runs") else "") + ".",
    ]
    lines += image_lines(plots, "throughput", "Tokens/s per configuration: stock transformers, ours, ours with "
                                              "a bf16 self-draft, ours with prompt lookup")
    if result["runs"]:
        lines += _decode_tables(result, env)
    lines += _speculation_tables(result, plots)
    return "\n".join(lines)


def merge_previous(result: dict, previous: dict) -> dict:
    """Fill the sections ``result`` did not measure from ``previous`` (an earlier run's JSON), each with the command
    and date that measured it; a decode section taken over keeps the read bandwidth measured with it (its
    roofline). Returns ``result``."""
    for key in _SECTION_KEYS:
        if not result.get(key) and previous.get(key):
            result[key] = previous[key]
            result["sections"][key] = previous.get("sections", {}).get(key) or {
                "command": _own_command(previous), "date": previous.get("date")}
            if key == "runs":
                result["environment"]["decode_bandwidth_gbs"] = _decode_bandwidth(previous["environment"])
    return result


def _decode_bandwidth(env) -> float:
    """The read bandwidth measured in the run that measured the decode section (the roofline's denominator): a
    later run of another section measures its own, which must not re-price the decode table."""
    return env.get("decode_bandwidth_gbs") or env["bandwidth_gbs"]


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
        roof = _decode_bandwidth(env) * 1e9 / run["weight_bytes"]
        same = sum(p["token_identical"] for p in run["prompts"])
        lines.append(
            f"| {run['dtype']} | {run['median_stock_tok_s']:.1f} | {run['median_ours_tok_s']:.1f} | "
            f"x{run['median_ratio']:.2f} | {roof:.1f} | token-identical on {same}/{len(run['prompts'])} prompts |"
        )
    padded = [run["dtype"] for run in result["runs"] if run.get("step_rows", 1) > 1]
    if padded:
        lines += ["", f"Ours in {', '.join(padded)} ran each decode step on the verify graph over "
                      f"{max(run.get('step_rows', 1) for run in result['runs'])} copies of the token: warm-up timed "
                      "that faster than the decode graph on this CPU (`IPEXGraphRunner.choose_step_rows`, "
                      "docs/architecture.md)."]
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


#: lookup columns that results from before 2026-11-30 do not have
_LOOKUP_OPTIONAL = (("mean_tokens_per_target_forward", "tokens per target forward"),
                    ("alone_ttft_s", "alone TTFT s"), ("lookup_ttft_s", "lookup TTFT s"))


def _fmt(value, spec, missing="-"):
    return format(value, spec) if value is not None else missing


def _speculation_tables(result, plots):
    lines = []
    if result.get("assisted"):
        int8 = any("int8" in row["config"] for row in result["assisted"])
        lines += ["", "## Assisted generation (speculative decoding), fp32 target", "",
                  "Target: SmolLM2 fp32 (ours). Draft: the same checkpoint exported in bf16 "
                  "(`target.self_draft(torch_dtype=torch.bfloat16)`)"
                  + (", or held as weight-only int8 on our PyTorch decoder (`target.self_draft(weights=\"int8\")`, "
                     "the int8 row)" if int8 else "") + ". Greedy; k = draft tokens per round. Decode "
                  "tok/s counts tokens after the first; end-to-end includes prefill (target and draft). Acceptance "
                  "rate = accepted / proposed draft tokens; tokens per target forward = mean tokens emitted per "
                  "verification step (accepted drafts + the target's own token); draft forward tokens = tokens the "
                  "draft ran through its own forward per call (prefill, catch-up, drafting), of which the rows it "
                  "copied from the target's KV cache instead (`shared_kv.py`; the \"draft's own cache\" row sets "
                  "`draft.share_target_kv = False`) are not part."]
        lines += image_lines(plots, "speedup_vs_k", "Assisted generation: speedup over ours alone against the "
                                                    "number of draft tokens k")
        lines += ["", "| configuration | decode tok/s | decode ratio vs ours alone | end-to-end ratio | TTFT s | "
                  "acceptance rate | tokens per target forward | draft forward tokens | rows copied from the target | "
                  "output |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in result["assisted"]:
            lines.append(
                f"| {row['config']} | {row['median_decode_tok_s']:.1f} | x{row['median_ratio_vs_ours_alone']:.2f} | "
                f"x{row['median_end_to_end_ratio_vs_ours_alone']:.2f} | {row['median_ttft_s']:.2f} | "
                f"{_fmt(row['acceptance_rate'], '.1%')} | {_fmt(row['mean_tokens_per_target_forward'], '.2f')} | "
                f"{_fmt(row.get('draft_forward_tokens_per_call'), '.0f')} | {_fmt(row.get('shared_rows_per_call'), '.0f')} | "
                f"{'identical to target alone' if row['token_identical_to_target_alone'] else 'DIFFERENT'} |"
            )
        viewed = [row for row in result["assisted"] if row.get("cost_model")]
        if viewed:
            lines += ["", "The cost model's view (`target.last_cost_model.report()`, medians over the row's runs): the "
                      "target's decode step and the draft's time per token as it measured them, its acceptance "
                      "estimate, the share of rounds it decoded without the draft, and its most chosen lengths.", "",
                      "| configuration | decode ms | draft ms/token | acceptance estimate | rounds without draft | "
                      "probes | most chosen k |", "|---|---|---|---|---|---|---|"]
            for row in viewed:
                view = row["cost_model"]
                lines.append(f"| {row['config']} | {_fmt(view['decode_ms'], '.1f')} | "
                             f"{_fmt(view['draft_ms_per_token'], '.1f')} | {_fmt(view['alpha'], '.2f')} | "
                             f"{_fmt(view['rounds_off_share'], '.0%')} | {view['probes']} | "
                             f"{', '.join(map(str, view['top_k']))} |")
        lines += ["", "Per prompt (prompts alternate: even = HumanEval code completion, odd = chatterbot question):", "",
                  "| configuration | prompt | kind | decode ratio | end-to-end ratio | acceptance rate |",
                  "|---|---|---|---|---|---|"]
        for row in result["assisted"]:
            if not row["config"].startswith("ours fp32 +"):
                continue
            for p in row["per_prompt"]:
                lines.append(f"| {row['config']} | {p['prompt']} | {p['kind']} | x{p['decode_ratio_vs_ours_alone']:.2f} | "
                             f"x{p['end_to_end_ratio']:.2f} | {_fmt(p['acceptance_rate'], '.1%')} |")
    if result.get("lookup"):
        rows = result["lookup"]
        extra = [key for key, _ in _LOOKUP_OPTIONAL if any(key in r for r in rows)]  # recorded since 2026-11-30
        titles = dict(_LOOKUP_OPTIONAL)
        lines += ["", f"## Prompt lookup decoding (`prompt_lookup_num_tokens={result['lookup_tokens']}`), fp32 target",
                  "", "Ours alone vs ours with prompt lookup "
                  + ("under the cost model (the default since 2026-12-03)" if any(r.get("schedule") == "cost"
                                                                                   for r in rows)
                     else "gating itself with its back-off (the default until 2026-12-03)")
                  + ", greedy, end-to-end tokens/s (prefill included). Grounded prompts: HumanEval code with an edit instruction, Lee-corpus news "
                  "articles with a restate or summarise instruction.", "",
                  "| prompt | kind | new tokens | alone tok/s | lookup tok/s | ratio | acceptance rate | "
                  + "".join(f"{titles[k]} | " for k in extra) + "output |",
                  "|---|---|---|---|---|---|---|" + "---|" * len(extra) + "---|"]
        for r in rows:
            lines.append(f"| {r['prompt']} | {r['kind']} | {r['new_tokens']} | {r['alone_tok_s']:.1f} | "
                         f"{r['lookup_tok_s']:.1f} | x{r['ratio']:.2f} | {_fmt(r['acceptance_rate'], '.1%')} | "
                         + "".join(f"{_fmt(r.get(k), '.2f')} | " for k in extra)
                         + f"{'identical' if r['token_identical'] else 'DIFFERENT'} |")
        kinds = sorted({r["kind"] for r in rows})
        summary = ", ".join(f"{k} median x{statistics.median(r['ratio'] for r in rows if r['kind'] == k):.2f}"
                            for k in kinds)
        lines += ["", f"Medians by kind: {summary}; slowest prompt x{min(r['ratio'] for r in rows):.2f}."]
        if len(extra) < len(_LOOKUP_OPTIONAL):
            lines += ["", "TTFT and tokens per target forward of this section are recorded by bench.py since "
                      "2026-11-30; these results predate that."]
    if result.get("universal"):
        uni = result["universal"]
        lines += ["", "## Universal assisted generation (different tokenizers), fp32", "",
                  f"Target: Gemma 3 270M (ours, {uni['target_backend']} backend; 262,144-entry vocabulary). Draft: "
                  f"SmolLM2-135M-Instruct (ours, {uni['draft_backend']} backend; 49,152 entries). Greedy, "
                  "`tokenizer=` / `assistant_tokenizer=`, the default schedule (our cost model for a target of ours, "
                  "benchmarks-cost-model.md); end-to-end tokens/s (prefill "
                  "included) vs the Gemma 3 target alone. Acceptance = accepted / proposed target-side tokens.", "",
                  "| prompt kind | new tokens | target alone tok/s | with draft tok/s | ratio | acceptance rate | "
                  "tokens per target forward | output |", "|---|---|---|---|---|---|---|---|"]
        for r in uni["rows"]:
            lines.append(f"| {r['kind']} | {r['new_tokens']} | {r['alone_tok_s']:.2f} | {r['universal_tok_s']:.2f} | "
                         f"x{r['ratio']:.2f} | {_fmt(r['acceptance_rate'], '.1%')} | "
                         f"{_fmt(r['mean_tokens_per_target_forward'], '.2f')} | "
                         f"{'identical' if r['token_identical'] else 'DIFFERENT'} |")
        slow = [r["kind"] for r in uni["rows"] if r["ratio"] < 1]
        lines += ["", "Why the gain is small: the draft costs about half a target step per token (Gemma 3 270M is 100M "
                  "parameters of layers plus a 168M-parameter embedding / LM head; SmolLM2 is 135M), and every round "
                  "re-encodes text. The cost model turns the draft off where it does not pay"
                  + (f"; below 1x here: {', '.join(slow)}." if slow else ".")]
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
    parser.add_argument("--only", default=None, choices=["decode", "assisted", "lookup", "universal"],
                        help="run one section only (the report then holds only that section)")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="only re-render --out from a results file written by --json")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        plots = render_plots(result, Path(args.out).parent, Path(args.out).stem) if args.out else {}
        report = render_markdown(result, plots)
        Path(args.out).write_text(report) if args.out else print(report)
        return
    args.draft_tokens = [int(k) for k in args.draft_tokens.split(",")]
    _heavy_imports()
    from tqdm.auto import tqdm

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
    sections = {"decode", "assisted", "lookup", "universal"} if args.only is None else {args.only}
    if args.no_assisted:
        sections.discard("assisted")
    if args.no_lookup:
        sections.discard("lookup")
    total = (len(dtypes) * args.rounds * len(prompts) * 2 if "decode" in sections else 0) + (
        args.rounds * len(prompts) * (len(args.draft_tokens) + 6) if "assisted" in sections else 0) + (
        args.rounds * 8 * 2 if "lookup" in sections else 0) + (args.rounds * 3 * 2 if "universal" in sections else 0)
    result["lookup_tokens"] = args.lookup_tokens
    result["prompt_count"] = len(prompts)
    with tqdm(total=total, desc="bench", unit="run") as bar:
        if "decode" in sections:
            for dtype in dtypes:
                bar.set_postfix_str(f"decode {str(dtype).replace('torch.', '')}")
                result["runs"].append(run_dtype(path, tokenizer, prompts, dtype, args, bar))
        if "assisted" in sections:
            bar.set_postfix_str("assisted")
            result["assisted"] = run_assisted(path, tokenizer, prompts, args, bar)
        if "lookup" in sections:
            bar.set_postfix_str("prompt lookup")
            result["lookup"] = run_lookup(path, tokenizer, args, bar)
        if "universal" in sections:
            bar.set_postfix_str("universal")
            result["universal"] = run_universal(args, bar)
    result["sections"] = {key: {"command": result["command"], "date": result["date"]}
                          for key in _SECTION_KEYS if result.get(key)}
    if args.only and args.json and Path(args.json).is_file():
        # one section re-measured: keep the other sections of the previous run, each with where it came from
        merge_previous(result, json.loads(Path(args.json).read_text()))
    plots = render_plots(result, Path(args.out).parent, Path(args.out).stem) if args.out else {}
    report = render_markdown(result, plots)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
