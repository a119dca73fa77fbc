"""Replay real acceptance traces through draft-length schedules: which schedule a pair calls for, without timing noise.

With greedy decoding, whether a round's i-th proposal is accepted depends only on where in the output it falls: the
draft proposes its greedy token after the target's own prefix (the round's earlier proposals, when accepted, are
the target's tokens). So the target's greedy output and the draft's teacher-forced greedy tokens over it (one
forward of prompt + output) give a trace, one digit per output token (1: the draft agrees here), that decides every
round of every schedule exactly. ``record`` measures traces and the pair's costs on this machine (1 thread):

- the target's forward over ``n`` tokens on a cache of the prompt (``n = 1``: a decode step; ``n > 1``: verification),
- the draft's forward over ``n`` tokens on a cache (``n = 1``: a draft step; more: catching up on the target's
  tokens) and its prefill of the prompt.

``replay`` runs each trace through constant ``k`` and through
:class:`optimum_ipex_spec.speculative.cost_model.CostModel`
(driven by :func:`speculate_by_cost` on a simulated clock that charges those costs) and prints decode tokens/s
against the target alone. It changes nothing in the runs it models: a schedule only decides how many tokens are
proposed, and every one is verified.

    python benchmarks/acceptance_replay.py record --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --draft-dtype bfloat16 --out /tmp/qwen-traces.json
    python benchmarks/acceptance_replay.py replay /tmp/qwen-traces.json

``record --gguf fast`` (or ``exact``) records the provisioned GGUF files of the pair instead, both compiled; a
compiled target verifies up to 4 tokens per call, which ``replay --variant verify_rows=4`` tells the cost model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

CHUNKS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def _forward_ms(model, past, chunks, rounds=3):
    """Median milliseconds of ``model``'s forward over each chunk length on a cache of ``past`` tokens, and of the
    prefill of that cache (:func:`verify_cost.chunk_forward_s`)."""
    from verify_cost import chunk_forward_s  # benchmarks/verify_cost.py, beside this file

    times, prefill_s = chunk_forward_s(model, past, chunks, rounds)
    return {n: round(1e3 * statistics.median(v), 1) for n, v in times.items()}, round(1e3 * prefill_s, 1)


def record(args) -> int:
    import datetime

    import torch
    import transformers
    from transformers import AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import resolve_model

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    if args.gguf:  # the provisioned GGUF files as shipped, both compiled (the pair of benchmarks/gguf_llamacpp.py)
        load = dict(weights="gguf", gguf_mode=args.gguf, torch_compile=True)
        target = IPEXModelForCausalLM.from_pretrained(args.target, **load)
        draft = IPEXModelForCausalLM.from_pretrained(args.draft, **load)
        args.target_dtype = args.draft_dtype = f"GGUF {args.gguf}"
    else:
        target = IPEXModelForCausalLM.from_pretrained(resolve_model(args.target), export=True,
                                                      torch_dtype=getattr(torch, args.target_dtype))
        draft = IPEXModelForCausalLM.from_pretrained(resolve_model(args.draft), export=True,
                                                     torch_dtype=getattr(torch, args.draft_dtype))
    traces = []
    for prompt in chat_prompts(tokenizer, n=args.prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            new = out[0, ids.shape[1]:]
            guesses = draft(out).logits[0, ids.shape[1] - 1:-1].argmax(-1)  # teacher-forced: one forward
        agree = "".join("1" if a else "0" for a in (guesses == new).tolist())
        traces.append({"prompt_tokens": ids.shape[1], "agree": agree[1:]})  # the first token is the prefill's
        print(f"prompt of {ids.shape[1]} tokens: draft agrees on {agree.count('1')}/{len(agree)}", file=sys.stderr)
    past = int(statistics.median(t["prompt_tokens"] for t in traces))
    target_ms, _ = _forward_ms(target, past, CHUNKS)
    draft_ms, draft_prefill_ms = _forward_ms(draft, past, CHUNKS)
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "transformers": transformers.__version__, "backend": target.backend, "target": args.target,
              "draft": args.draft, "target_dtype": args.target_dtype, "draft_dtype": args.draft_dtype,
              "new_tokens": args.new_tokens, "past": past,
              "target_ms": target_ms, "draft_ms": draft_ms, "draft_prefill_ms": draft_prefill_ms, "traces": traces}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "traces"}, indent=1))
    return 0


class ReplayedDraft:
    """A candidate generator on a simulated clock: each call charges the draft's catch-up on the tokens it has
    not seen (its prefill on the first call) and ``k - 1`` draft steps, and proposes ``k`` tokens; the trace
    decides how many of them the replay loop accepts."""

    def __init__(self, clock, costs, k, slow):
        self.clock, self.costs, self.num_assistant_tokens, self.slow = clock, costs, k, slow
        self.seen = None  # tokens in the draft's cache
        self.room = k  # proposals that fit before the last token (set by the replay loop each round)

    def get_candidates(self, input_ids):
        import torch

        k, length = min(int(self.num_assistant_tokens), self.room), input_ids.shape[1]
        if k == 0:  # no room for a proposal before max_new_tokens: a plain step, as in transformers
            return input_ids, None
        unseen = length if self.seen is None else length - self.seen
        first = self.costs["draft_prefill_ms"] if self.seen is None else _chunk(self.costs["draft_ms"], unseen)
        self.clock[0] += 1e-3 * self.slow() * (first + (k - 1) * self.costs["draft_ms"]["1"])
        self.seen = length + k - 1
        return torch.cat([input_ids, torch.zeros(1, k, dtype=torch.long)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.seen = min(self.seen, input_ids.shape[1] - 1)  # its accepted proposals stay; the target's token is new


def _chunk(table, n):
    """Milliseconds of a forward over ``n`` tokens: measured up to the longest chunk, linear beyond it."""
    longest = max(int(c) for c in table)
    if n <= longest:
        return table[str(max(1, n))]
    slope = (table[str(longest)] - table["1"]) / (longest - 1)
    return table[str(longest)] + slope * (n - longest)


def replay_one(costs, trace, schedule, noise=0.0, seed=0):
    """Decode tokens/s of ``schedule`` (a dict of :class:`CostModel` settings, or an int ``k``; 0 = the target
    alone) on one trace, and the cost model (None for a constant schedule). ``noise``: other work on the machine,
    as a factor ``1 + X`` on every charged cost, ``X`` exponential with mean ``noise`` (seeded by ``seed``):
    interference only adds time."""
    import random

    import torch

    from optimum_ipex_spec.speculative.cost_model import CostModel, speculate_by_cost

    rng = random.Random(seed)

    def slow():
        return 1.0 + (rng.expovariate(1.0 / noise) if noise > 0 else 0.0)

    clock = [0.0]
    draft = ReplayedDraft(clock, costs, schedule if isinstance(schedule, int) else 8, slow)
    model = None
    if not isinstance(schedule, int):
        model = CostModel(max_tokens=8, plain_first=True, **schedule)
        speculate_by_cost(draft, model, clock=lambda: clock[0])
    agree, made = [a == "1" for a in trace["agree"]], 0
    length = trace["prompt_tokens"] + 1
    while made < len(agree):
        ids = torch.zeros(1, length, dtype=torch.long)
        draft.room = len(agree) - made - 1  # the round's own token must fit too
        if schedule == 0:
            proposed = ids
        else:
            proposed, _ = draft.get_candidates(ids)
        k = proposed.shape[1] - length
        clock[0] += 1e-3 * slow() * costs["target_ms"][str(min(k + 1, max(CHUNKS)))]
        accepted = 0
        while accepted < k and made + accepted < len(agree) and agree[made + accepted]:
            accepted += 1
        if schedule != 0:
            draft.update_candidate_strategy(proposed[:, : length + accepted + 1], torch.zeros(1, k + 1, 2),
                                            accepted)
        made += accepted + 1
        length += accepted + 1
    return made / clock[0], model


def ratios(data, schedule, noise=0.0, seeds=1):
    """Per trace: decode tokens/s of ``schedule`` over the target alone's (the median over ``seeds`` noisy
    replays of each, the target alone replayed with the same noise)."""
    out = []
    for trace in data["traces"]:
        per_seed = [replay_one(data, trace, schedule, noise, seed)[0] / replay_one(data, trace, 0, noise, seed)[0]
                    for seed in range(seeds)]
        out.append(statistics.median(per_seed))
    return out


def replay(args) -> int:
    data = json.loads(Path(args.traces).read_text())
    schedules = [("target alone", 0)] + [(f"constant k={k}", k) for k in (1, 2, 3, 4, 5, 6, 8)]
    schedules += [("cost model", {})]
    for spec in args.variant or []:  # e.g. decay=0.9
        settings = dict(kv.split("=") for kv in spec.split(","))
        schedules.append((f"cost model {spec}", {k: float(v) if "." in v else int(v) for k, v in settings.items()}))
    print(f"{data['target']} ({data['target_dtype']}) + {data['draft']} ({data['draft_dtype']}): target step "
          f"{data['target_ms']['1']:.0f} ms, verify 5 tokens {data['target_ms']['5']:.0f} ms, draft step "
          f"{data['draft_ms']['1']:.0f} ms; {len(data['traces'])} traces of {data['new_tokens']} tokens, agreement "
          + ", ".join(f"{t['agree'].count('1') / len(t['agree']):.0%}" for t in data["traces"]))
    print("| schedule | decode x target alone (median) | worst trace | per trace |\n|---|---|---|---|")
    for name, schedule in schedules:
        found = ratios(data, schedule, args.noise, args.seeds if args.noise else 1)
        print(f"| {name} | x{statistics.median(found):.2f} | x{min(found):.2f} | "
              + " ".join(f"{r:.2f}" for r in found) + " |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="measure traces and costs of a pair")
    rec.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    rec.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    rec.add_argument("--target-dtype", default="float32", choices=["float32", "bfloat16"])
    rec.add_argument("--draft-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    rec.add_argument("--gguf", choices=["exact", "fast"],
                     help="the provisioned GGUF files in this mode, compiled, instead of the dense folders")
    rec.add_argument("--prompts", type=int, default=4)
    rec.add_argument("--new-tokens", type=int, default=128)
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="replay recorded traces through the schedules")
    rep.add_argument("traces")
    rep.add_argument("--variant", action="append", help="CostModel settings to compare, e.g. decay=0.9")
    rep.add_argument("--noise", type=float, default=0.0, help="mean extra time per forward from other work (share)")
    rep.add_argument("--seeds", type=int, default=9, help="noisy replays per trace (with --noise)")
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    raise SystemExit(main())
