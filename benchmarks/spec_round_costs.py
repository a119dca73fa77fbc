"""Where a speculative round's time goes, and the speedup its measured costs allow (issue 48).

One target and one draft of ours (default: the 1.5B and 0.5B GGUF files in the fast mode, both compiled), greedy,
a constant ``K`` draft tokens per round, on real chat prompts; each prompt also decoded by the target alone,
interleaved. Every forward call of both models is timed by its row count, so a round splits into the target's
verification (``K + 1`` rows), the draft's steps (1 row) and catch-ups (2 rows after a round that accepted all
``K``), and the rest (transformers' assisted loop, our candidate generator). Beside the measured speedup over the
target alone it prints the bound of Leviathan et al. (2023, arXiv 2211.17192, section 3) for these costs:
``E(k) / (k c + v)`` with ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens per round at the measured acceptance ``a``, a
draft step ``c`` and a verification ``v`` in target decode steps (the catch-ups and the loop taken as free), the
best ``k`` up to the verification graph's rows. Decode time only: each call's prefills (both models' prompt) are
timed apart. Usage::

    python benchmarks/spec_round_costs.py --threads 1 --prompts 3 --new-tokens 128
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time


def timed_calls(model, name: str, log: dict) -> None:
    """Wrap ``model.runner.forward`` so that each call's seconds go to ``log[(name, rows)]``."""
    forward = model.runner.forward

    def timed(input_ids, *args, **kwargs):
        start = time.perf_counter()
        out = forward(input_ids, *args, **kwargs)
        log[(name, input_ids.shape[1])].append(time.perf_counter() - start)
        return out

    model.runner.forward = timed


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of ``k`` proposals yields when each is accepted with probability ``acceptance``."""
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--mode", default="fast", choices=["exact", "fast"])
    parser.add_argument("--draft-weights", default="gguf", choices=["gguf", "int4"],
                        help="the draft's GGUF file, or its int4 copy quantized at load from the fp32 folder")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.backends.pytorch.compiled_step import CHUNK_ROWS
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import resolve_model

    torch.set_num_threads(args.threads)
    load = dict(weights="gguf", gguf_mode=args.mode, torch_compile=True)
    target = IPEXModelForCausalLM.from_pretrained(args.target, **load)
    if args.draft_weights == "int4":
        draft = IPEXModelForCausalLM.from_pretrained(resolve_model(args.draft), export=True, weights="int4",
                                                     gguf_mode=args.mode, torch_compile=True)
    else:
        draft = IPEXModelForCausalLM.from_pretrained(args.draft, **load)
    for model in (target, draft):
        model.compile_chunk_step()
    draft.generation_config.num_assistant_tokens = args.k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    prompts = [tokenizer(p, return_tensors="pt") for p in chat_prompts(tokenizer, n=args.prompts)]
    target.generate(**prompts[0], max_new_tokens=8, do_sample=False, assistant_model=draft)  # warm both graphs
    calls = collections.defaultdict(list)
    timed_calls(target, "target", calls)
    timed_calls(draft, "draft", calls)
    decode = {"alone": 0.0, "speculative": 0.0}
    tokens = {"alone": 0, "speculative": 0}
    accepted = proposed = rounds = 0
    for inputs in prompts:
        length = inputs["input_ids"].shape[1]
        for kind in ("alone", "speculative"):
            calls_before = {key: len(times) for key, times in calls.items()}
            extra = {"assistant_model": draft} if kind == "speculative" else {}
            start = time.perf_counter()
            out = target.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False, **extra)
            seconds = time.perf_counter() - start
            # the prefills: the calls over the prompt's rows (the target's, and the draft's own)
            prefill = sum(t for key, times in calls.items() if key[1] >= length - 1
                          for t in times[calls_before.get(key, 0):])
            decode[kind] += seconds - prefill
            tokens[kind] += out.shape[1] - length - 1
            if kind == "speculative":
                stats = draft.last_speculation_stats
                accepted, proposed, rounds = accepted + stats.accepted, proposed + stats.proposed, rounds + stats.rounds
    step = statistics.median(calls[("target", 1)])
    print(f"{args.target} + {args.draft} ({args.draft_weights}), GGUF {args.mode}, {args.threads} thread(s), "
          f"k={args.k}, {len(prompts)} prompts x {args.new_tokens} tokens")
    print("| call | calls | median ms | in target decode steps |")
    print("|---|---|---|---|")
    for (name, rows), times in sorted(calls.items()):
        if rows < max(8, CHUNK_ROWS + 1):  # the prefills are not a round's work
            print(f"| {name}, {rows} row(s) | {len(times)} | {statistics.median(times) * 1e3:.1f} | "
                  f"{statistics.median(times) / step:.2f} |")
    alone_rate = tokens["alone"] / decode["alone"]
    spec_rate = tokens["speculative"] / decode["speculative"]
    acceptance = accepted / proposed if proposed else 0.0
    c = statistics.median(calls[("draft", 1)]) / step
    v = statistics.median(calls[("target", args.k + 1)]) / step if calls[("target", args.k + 1)] else None
    per_round = tokens["speculative"] / max(rounds, 1)
    print(f"\nacceptance {acceptance:.3f}, {rounds} rounds, {per_round:.2f} tokens a round")
    print(f"decode: alone {alone_rate:.2f} tok/s, speculative {spec_rate:.2f} tok/s: x{spec_rate / alone_rate:.2f}")
    if v is not None:
        bounds = {k: expected_tokens(acceptance, k) / (k * c + v) for k in range(1, CHUNK_ROWS)}
        best = max(bounds, key=bounds.get)
        print(f"bound at these costs (draft step c = {c:.2f}, verification v = {v:.2f} steps, catch-ups and the "
              f"loop free): x{bounds[best]:.2f} at k={best}; at k={args.k}: x{bounds[args.k]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
