"""The cost model's draft lengths against transformers' constant schedule and the target alone.

Pairs (1 thread, greedy, fp32 targets, one process, interleaved rounds; a ratio is the median over rounds of the
target alone's time over the configuration's in the same round, robust to the machine's drift):
SmolLM2-135M fp32 + its bf16 self-draft; SmolLM2-135M fp32 + a draft of the same architecture with random
weights (useless: it never agrees); universal assisted generation with Gemma 3 270M, and with Qwen2.5-Coder-0.5B,
as target and SmolLM2-135M as draft (different tokenizers). Output must be identical to the target alone (asserted).
Writes docs/benchmarks-cost-model.md.

Check (exit status 1 when it fails): with the useless draft, the cost model spends most rounds without the draft
and the run is within 10% of the target alone (issue: speculation that always pays).

    python benchmarks/cost_model.py [--new-tokens 128] [--rounds 3] [--only useless]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks-cost-model.md"


def _pairs(only=None):
    """Yield ``(name, target, draft, generate kwargs, [(label, prompt)], tokenizer)``; models are built only for the
    pairs whose name contains ``only`` (all when None)."""
    from transformers import AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts, humaneval_prompts, news_articles

    def wanted(name):
        return only is None or only.lower() in name.lower()

    names = ["SmolLM2 fp32 + bf16 self-draft", USELESS, "Gemma 3 270M + SmolLM2 (universal)",
             "Qwen2.5-Coder 0.5B + SmolLM2 (universal)"]
    smol = smol_tok = None
    if any(wanted(name) for name in names):
        smol = IPEXModelForCausalLM.from_pretrained("smollm2-135m-instruct", export=True)
        smol_tok = AutoTokenizer.from_pretrained(smol.source)
    smol_prompts = [("code", humaneval_prompts()[0]), ("chat", chat_prompts(smol_tok)[1])] if smol else []
    if wanted(names[0]):
        yield (names[0], smol, smol.self_draft(), {}, smol_prompts, smol_tok)
    if wanted(names[1]):
        yield (names[1], smol, _random_draft(smol.source), {}, smol_prompts, smol_tok)
    if wanted(names[2]):
        gemma = IPEXModelForCausalLM.from_pretrained("gemma3-270m", export=True)
        gemma_tok = AutoTokenizer.from_pretrained(gemma.source)
        yield (names[2], gemma, smol, dict(tokenizer=gemma_tok, assistant_tokenizer=smol_tok),
               [("code", humaneval_prompts()[0]), ("news", news_articles()[0][:400])], gemma_tok)
        del gemma
    if wanted(names[3]):
        qwen = IPEXModelForCausalLM.from_pretrained("qwen2.5-coder-0.5b-instruct", export=True)
        qwen_tok = AutoTokenizer.from_pretrained(qwen.source)
        yield (names[3], qwen, smol, dict(tokenizer=qwen_tok, assistant_tokenizer=smol_tok),
               [("code", humaneval_prompts()[0]), ("news", news_articles()[0][:400])], qwen_tok)


USELESS = "SmolLM2 fp32 + random-weights draft (useless)"


def _random_draft(source: str):
    """A bf16 draft of the target's architecture and tokenizer with seeded random weights: its proposals are
    (almost) never accepted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), torch_dtype=torch.bfloat16)
    return IPEXModelForCausalLM.from_transformers_model(model.eval(), dtype=torch.bfloat16)


def useless_draft_failures(rows) -> list:
    """The rows of the useless draft that break the check: below x0.90 of the target alone, or fewer rounds
    without the draft than with it."""
    failures = []
    for row in rows:
        if row["pair"] != USELESS:
            continue
        view = row["cost_model"]
        drafted = sum(n for k, n in view["chosen_k"].items() if int(k) > 0)
        if row["cost"] < 0.90 or view["rounds_off"] <= drafted:
            failures.append(f"{row['prompt']}: x{row['cost']}, {view['rounds_off']} rounds off, {drafted} drafting")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=None, help="run only the pairs whose name contains this text")
    parser.add_argument("--out", default=None, help="markdown table to write (default: docs/benchmarks-cost-model.md "
                        "for a run of every pair; nothing for an --only run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, target, draft, extra, prompts, tok in _pairs(args.only):
        for label, prompt in prompts:
            ids = tok(prompt, return_tensors="pt")
            times, report = {}, None
            configs = [("alone", {}), ("cost", dict(assistant_model=draft, **extra)),
                       ("constant", dict(assistant_model=draft, num_assistant_tokens_schedule="constant", **extra))]
            for _ in range(args.rounds):
                for config, kwargs in configs:
                    start = time.perf_counter()
                    out = target.generate(**ids, max_new_tokens=args.new_tokens, do_sample=False, **kwargs)
                    times.setdefault(config, []).append(time.perf_counter() - start)
                    if config == "alone":
                        reference = out
                    else:
                        assert torch.equal(out, reference), (name, label, config)
                    if config == "cost":
                        report = target.last_cost_model.report()
            def ratio(config):
                return round(statistics.median(a / c for a, c in zip(times["alone"], times[config])), 2)

            rows.append(dict(pair=name, prompt=label,
                             alone_tok_s=round(args.new_tokens / statistics.median(times["alone"]), 2),
                             cost=ratio("cost"), constant=ratio("constant"), cost_model=report))
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        "# Cost-aware draft length (`num_assistant_tokens_schedule=\"cost\"`, the default)",
        "",
        f"`python benchmarks/cost_model.py --new-tokens {args.new_tokens} --rounds {args.rounds}"
        + (f" --only {args.only!r}" if args.only else "") + "`: 1 thread, greedy, "
        "end-to-end time (prefill included) of `generate()`; a ratio is the median over the interleaved rounds of "
        "the target alone's time over the configuration's in the same round; output identical to the target alone in every run (asserted). "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}. `constant`: transformers' "
        "constant schedule at the draft's `num_assistant_tokens` (8 for the self-draft, 20 for SmolLM2 as a "
        "universal draft). The cost model's view is that of the last cost run: chosen lengths `k: rounds`, plain "
        "rounds, probes, its measurements in ms, and its decayed share of drafting rounds that yielded nothing to "
        "verify (empty rounds).",
        "",
        "| pair | prompt | target alone tok/s | cost model | constant | chosen k | rounds off / probes | "
        "decode ms | draft ms/token | acceptance | empty rounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        view = row["cost_model"]
        lines.append(f"| {row['pair']} | {row['prompt']} | {row['alone_tok_s']} | x{row['cost']} | x{row['constant']} | "
                     f"{view['chosen_k']} | {view['rounds_off']} / {view['probes']} | {view['decode_ms']} | "
                     f"{view['draft_ms_per_token']} | {view['alpha']} | {view.get('empty_share', '')} |")
    failures = useless_draft_failures(rows)
    lines += ["", "Check, the useless draft (random weights): within 10% of the target alone and most rounds without "
              "the draft: " + ("**failed**: " + "; ".join(failures) if failures else "passed") + "."]
    out = Path(args.out) if args.out else (None if args.only else DOC)
    if out is not None:
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out}")
    else:
        print("\n".join(lines))
    if failures:
        print("useless-draft check failed: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
