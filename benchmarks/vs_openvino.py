"""Ours against OpenVINO GenAI (Intel's current CPU stack), side by side on the same prompts (issue 15).

Two processes, one lane each, taking turns: this one (the IPEX lane by default) holds our SmolLM2 fp32 export
and its self-drafts; a worker in the ``openvino`` lane (``requirements/openvino.txt``: optimum-intel exports the
checkpoint to OpenVINO IR, openvino-genai runs ``LLMPipeline``) holds OpenVINO's fp32 model, alone and with a
weight-only int8 copy as its draft model (``ov_genai.draft_model``: GenAI's speculative decoding). Each round runs
every prompt through every configuration, OpenVINO's then ours, one thread each, while the other process waits.
Both get the same input ids (our tokenizer; GenAI's ``TokenizedInputs``, no chat template added by either), greedy,
``--new-tokens`` tokens (no early stop at eos: ``ignore_eos`` / ``min_new_tokens``). Timing as everywhere here: time
to first token, and decode tokens/s = tokens after the first / time from the first to the last token (a
streamer's stamps on both sides). Ratios per prompt against each stack's own fp32 model alone and against our fp32
alone, then medians over prompts; outputs are compared token by token with each stack's own target alone.

Usage (the worker's lane is built on first use)::

    python benchmarks/vs_openvino.py --out docs/benchmarks-openvino.md --json docs/benchmarks-openvino.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
#: our fp32 target alone, the row every ratio of ours is taken against: the default export (IPEX's graphs where the
#: lane has IPEX, else our eager decoder), or with ``--target-torch-compile`` the pure-PyTorch path compiled
OURS_ALONE, OURS_COMPILED_ALONE = "ours fp32 alone", "ours fp32 compiled alone"


# ------------------------------------------------------------------ the OpenVINO side (openvino lane)
def export_ir(source: str, out: Path, weight_format: str) -> None:
    """``optimum-cli export openvino`` (optimum-intel): a stateful IR with the converted tokenizer, its weights in
    fp32 or compressed to weight-only int8 (``--weight-format int8``: NNCF's asymmetric per-channel int8). Skipped
    when ``out`` already holds one."""
    if (out / "openvino_model.xml").is_file():
        return
    cli = Path(sys.executable).parent / "optimum-cli"
    subprocess.run([str(cli), "export", "openvino", "--model", source, "--task", "text-generation-with-past",
                    "--weight-format", weight_format, str(out)], check=True)
    if not (out / "openvino_tokenizer.xml").is_file():
        # openvino-tokenizers 2026.4.1 fails on this tokenizer's detokenizer, and the export then writes neither
        # model (a warning only); the pipeline needs the encoder to start, the ids are ours (TokenizedInputs)
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        ov.save_model(convert_tokenizer(AutoTokenizer.from_pretrained(source), with_detokenizer=False),
                      str(out / "openvino_tokenizer.xml"))


def worker(ir_root: Path, threads: int) -> None:
    """Serve ``{"config", "ids", "new_tokens", "k"}`` lines on stdin with timing lines on stdout."""
    import openvino_genai as ov_genai
    import openvino as ov
    import numpy as np

    properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
    target_dir, draft_dir = str(ir_root / "fp32"), str(ir_root / "int8")
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = 1  # GB of KV cache blocks: plenty for 1 sequence of a few hundred tokens
    alone = ov_genai.LLMPipeline(target_dir, "CPU", **properties)
    speculative = ov_genai.LLMPipeline(target_dir, "CPU", scheduler_config=scheduler,
                                       draft_model=ov_genai.draft_model(draft_dir, "CPU", **properties), **properties)
    draft_alone = ov_genai.LLMPipeline(draft_dir, "CPU", **properties)
    # the target alone on the continuous-batching pipeline, the one speculative decoding runs the target on
    batched = ov_genai.LLMPipeline(target_dir, "CPU", scheduler_config=scheduler, **properties)
    pipes = {"alone": alone, "speculative": speculative, "draft alone": draft_alone, "batched alone": batched}
    print(json.dumps({"ready": True, "openvino": ov.__version__, "openvino_genai": ov_genai.__version__}), flush=True)

    class Streamer(ov_genai.StreamerBase):
        def __init__(self):
            super().__init__()
            self.stamps, self.counts = [], []

        def write(self, token):
            self.stamps.append(time.perf_counter())
            self.counts.append(len(token) if isinstance(token, (list, tuple)) else 1)
            return ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    for line in sys.stdin:
        request = json.loads(line)
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = request["new_tokens"]
        config.min_new_tokens = request["new_tokens"]
        config.ignore_eos = True
        config.do_sample = False
        if request["config"] == "speculative":
            config.num_assistant_tokens = request["k"]
        ids = np.array([request["ids"]], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        streamer = Streamer()
        start = time.perf_counter()
        result = pipes[request["config"]].generate(inputs, config, streamer)
        finish = time.perf_counter()
        tokens = [int(t) for t in result.tokens[0]]
        decode_tokens = sum(streamer.counts) - streamer.counts[0]
        span = streamer.stamps[-1] - streamer.stamps[0]
        print(json.dumps({"tokens": tokens, "ttft_s": streamer.stamps[0] - start,
                          "decode_tokens_per_s": decode_tokens / span if span > 0 else float("nan"),
                          "total_s": finish - start, "streamed": sum(streamer.counts)}), flush=True)


# ------------------------------------------------------------------ our side, and the rounds (any lane with ours)
class OpenVINOWorker:
    """The worker process in the ``openvino`` lane: one request line in, one result line out."""

    def __init__(self, python: str, ir_root: Path, threads: int):
        self.process = subprocess.Popen([python, __file__, "--worker", str(ir_root), "--threads", str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the OpenVINO worker stopped (exit status {self.process.wait()}); its error is above")
        return json.loads(line)

    def run(self, config: str, ids, new_tokens: int, k: int = 0) -> dict:
        self.process.stdin.write(json.dumps({"config": config, "ids": ids, "new_tokens": new_tokens, "k": k}) + "\n")
        return self._read()

    def peak_rss_gb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / (1 << 20)

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


def openvino_python() -> str:
    """The ``openvino`` lane's interpreter (built on first use, like every lane)."""
    venv = subprocess.run(["bash", str(HERE / "scripts" / "ensure-venv.sh"), "openvino"], check=True,
                          stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    return str(Path(venv) / "bin" / "python")


def _peak_rss_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / (1 << 20)


def measure(args) -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import resolve_model
    from optimum_ipex_spec.utils.import_utils import ipex_status
    from optimum_ipex_spec.utils.timing import timed_generate

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    python = openvino_python()
    ir_root = Path(os.environ.get("OPTIMUM_IPEX_SPEC_CACHE", Path.home() / ".cache" / "optimum_ipex_spec")) / \
        "openvino" / args.model
    for weight_format in ("fp32", "int8"):
        subprocess.run([python, __file__, "--export-ir", str(path), str(ir_root / weight_format), weight_format],
                       check=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tokenizer, n=args.prompts)
    worker = OpenVINOWorker(python, ir_root, args.threads)
    # the target as a user of this lane runs it best: on the pure-PyTorch path, compiled (torch_compile=True)
    target = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=torch.float32,
                                                  **({"torch_compile": True} if args.target_torch_compile else {}))
    ours_alone = OURS_COMPILED_ALONE if args.target_torch_compile else OURS_ALONE
    makers = {"bf16": lambda: target.self_draft(torch_dtype=torch.bfloat16),
              "int8": lambda: target.self_draft(weights="int8"),
              "bf16 compiled": lambda: target.self_draft(torch_dtype=torch.bfloat16, torch_compile=True),
              "int8 compiled": lambda: target.self_draft(weights="int8", torch_compile=True)}
    drafts = {name: makers[name]() for name in args.ours_drafts}
    configs = [("OpenVINO fp32 alone", "ov", "alone", 0),
               ("OpenVINO fp32 alone, continuous-batching pipeline", "ov", "batched alone", 0),
               ("OpenVINO int8 alone (the draft)", "ov", "draft alone", 0)]
    configs += [(f"OpenVINO fp32 + int8 draft, k={k}", "ov", "speculative", k) for k in args.draft_tokens]
    configs += [(ours_alone, "ours", None, 0)]
    configs += [(f"{ours_alone.removesuffix(' alone')} + {name} self-draft, cost model (default)", "ours", name, 0)
                for name in drafts]
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    samples = {name: {i: [] for i in range(len(prompts))} for name, *_ in configs}
    warm = tokenizer(prompts[0], return_tensors="pt")
    for name, stack, what, k in configs:  # first calls (graph warm-up, torch.compile) are not measured
        if stack == "ov":
            worker.run(what, warm["input_ids"][0].tolist(), 16, k)
        else:
            extra = {"assistant_model": drafts[what]} if what else {}
            target.generate(**warm, max_new_tokens=16, do_sample=False, **extra)
    outputs = {name: {} for name, *_ in configs}
    accepted = {name: [0, 0] for name, *_ in configs}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            inputs = tokenizer(prompt, return_tensors="pt")
            ids = inputs["input_ids"][0].tolist()
            for name, stack, what, k in configs:
                if stack == "ov":
                    result = worker.run(what, ids, args.new_tokens, k)
                    tokens, timing = result["tokens"], result
                else:
                    extra = {"assistant_model": drafts[what]} if what else {}
                    out, t = timed_generate(target, inputs, **gen, **extra)
                    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
                    timing = {"ttft_s": t.ttft_s, "decode_tokens_per_s": t.decode_tokens_per_s, "total_s": t.total_s}
                    stats = drafts[what].last_speculation_stats if what else None
                    if stats is not None:
                        accepted[name][0] += stats.accepted
                        accepted[name][1] += stats.proposed
                outputs[name].setdefault(i, tokens)
                samples[name][i].append(timing)
    rss = {"ours": _peak_rss_gb(), "openvino": worker.peak_rss_gb()}
    worker.close()

    def per_prompt(name, field):
        return [statistics.median(t[field] for t in samples[name][i]) for i in range(len(prompts))]

    rows = []
    for name, stack, what, k in configs:
        own = "OpenVINO fp32 alone" if stack == "ov" else ours_alone
        rate, own_rate = per_prompt(name, "decode_tokens_per_s"), per_prompt(own, "decode_tokens_per_s")
        ours_rate = per_prompt(ours_alone, "decode_tokens_per_s")
        total, own_total = per_prompt(name, "total_s"), per_prompt(own, "total_s")
        rows.append({
            "config": name, "stack": stack, "k": k or None,
            "median_decode_tok_s": statistics.median(rate),
            "median_decode_ratio_vs_own_fp32_alone": statistics.median(r / b for r, b in zip(rate, own_rate)),
            "worst_decode_ratio_vs_own_fp32_alone": min(r / b for r, b in zip(rate, own_rate)),
            "median_decode_ratio_vs_ours_fp32_alone": statistics.median(r / b for r, b in zip(rate, ours_rate)),
            "median_end_to_end_ratio_vs_own_fp32_alone": statistics.median(b / t for t, b in zip(total, own_total)),
            "median_ttft_s": statistics.median(per_prompt(name, "ttft_s")),
            "acceptance_rate": accepted[name][0] / accepted[name][1] if accepted[name][1] else None,
            "identical_to_own_fp32_alone": all(outputs[name][i] == outputs[own][i] for i in range(len(prompts))),
            "first_difference_per_prompt": [_first_difference(outputs[name][i], outputs[own][i])
                                            for i in range(len(prompts))],
            **({"first_difference_vs_batched_alone_per_prompt": [
                _first_difference(outputs[name][i], outputs["OpenVINO fp32 alone, continuous-batching pipeline"][i])
                for i in range(len(prompts))]} if stack == "ov" else {}),
        })
    agree = [_common_prefix_length(outputs["OpenVINO fp32 alone"][i], outputs[ours_alone][i])
             for i in range(len(prompts))]
    return {
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([os.path.relpath(__file__, HERE)] + sys.argv[1:]),
        "model": args.model, "threads": args.threads, "new_tokens": args.new_tokens, "prompts": len(prompts),
        "rounds": args.rounds, "ours_target": ours_alone.removesuffix(" alone"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "ipex": ipex_status().ipex_version, **{k: v for k, v in worker.info.items() if k != "ready"}},
        "peak_rss_gb": rss,
        "fp32_outputs_common_prefix_tokens": agree,
        "rows": rows,
    }


def _first_difference(a, b):
    """Index of the first token where two outputs differ (``None``: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _common_prefix_length(a, b):
    """How many leading tokens two outputs share."""
    first = _first_difference(a, b)
    return len(a) if first is None else first


def render(result: dict) -> str:
    v = result["versions"]
    ours = result.get("ours_target", "ours fp32")
    compiled = ours == OURS_COMPILED_ALONE.removesuffix(" alone")
    lines = [
        "# Benchmarks: ours against OpenVINO GenAI",
        "",
        f"Generated by `{result['command']}` on {result['date']}: {result['model']}, {result['threads']} thread(s) "
        f"per stack, {result['new_tokens']} new tokens (no early stop), greedy, {result['prompts']} real prompts "
        f"(HumanEval code and chatterbot questions, chat template, the same input ids for both), {result['rounds']} "
        "rounds; each round runs every prompt through every configuration, OpenVINO's (a worker process in the "
        "`openvino` lane) then ours, one process waiting while the other runs; per prompt the median over rounds, "
        "then the median over prompts (worst prompt in brackets). Ours: torch "
        f"{v['torch']}, transformers {v['transformers']}, IPEX {v['ipex'] or '-'}"
        + ("; the fp32 target compiled (`torch_compile=True`: the pure-PyTorch path's compiled step), its "
           "self-drafts reading its KV cache" if compiled else "") + f"; OpenVINO {v.get('openvino')}, "
        f"openvino-genai {v.get('openvino_genai')} (IR exported by optimum-intel; the draft's weights compressed to "
        "int8 by NNCF; fp32 inference precision).",
        "",
        f"| configuration | decode tok/s | vs its own fp32 alone (worst) | vs {ours} alone | end to end vs its own "
        "fp32 alone | TTFT s | acceptance rate | output vs its own fp32 alone |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def output(row):
        if row["identical_to_own_fp32_alone"]:
            return "identical"
        firsts = ", ".join("-" if i is None else str(i) for i in row["first_difference_per_prompt"])
        return f"DIFFERENT (first differing token per prompt: {firsts})"

    for row in result["rows"]:
        acc = f"{row['acceptance_rate']:.1%}" if row["acceptance_rate"] is not None else "-"
        lines.append(
            f"| {row['config']} | {row['median_decode_tok_s']:.1f} | x{row['median_decode_ratio_vs_own_fp32_alone']:.2f} "
            f"(x{row['worst_decode_ratio_vs_own_fp32_alone']:.2f}) | x{row['median_decode_ratio_vs_ours_fp32_alone']:.2f} | "
            f"x{row['median_end_to_end_ratio_vs_own_fp32_alone']:.2f} | {row['median_ttft_s']:.2f} | {acc} | "
            f"{output(row)} |")
    batched = [row for row in result["rows"] if "first_difference_vs_batched_alone_per_prompt" in row]
    if batched:
        lines += ["", "OpenVINO's outputs against its fp32 target alone on the continuous-batching pipeline (the "
                  "pipeline its speculative decoding verifies on), first differing token per prompt (- = identical):",
                  ""]
        lines += [f"- {row['config']}: " + ", ".join("-" if i is None else str(i) for i in
                                                    row["first_difference_vs_batched_alone_per_prompt"])
                  for row in batched]
    rss = result["peak_rss_gb"]
    lines += [
        "",
        f"Peak RSS of each process (both targets and drafts loaded): ours {rss['ours']:.2f} GB, OpenVINO "
        f"{rss['openvino']:.2f} GB. The two fp32 models' greedy outputs agree on the first "
        f"{result['fp32_outputs_common_prefix_tokens']} tokens of each prompt (different kernels round differently;"
        " each stack's speculative output is compared with its own fp32 model alone).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft-tokens", default="4,8", help="OpenVINO's num_assistant_tokens values")
    parser.add_argument("--ours-drafts", default="bf16,int8,int8 compiled",
                        help="our self-drafts: bf16, int8, bf16 compiled, int8 compiled (comma-separated)")
    parser.add_argument("--target-torch-compile", action="store_true",
                        help="our fp32 target with torch_compile=True (the pure-PyTorch path's compiled step)")
    parser.add_argument("--out", default=None, help="markdown report path")
    parser.add_argument("--json", default=None, help="machine-readable results path")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--export-ir", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker), args.threads)
    if args.export_ir:
        return export_ir(args.export_ir[0], Path(args.export_ir[1]), args.export_ir[2])
    args.draft_tokens = [int(k) for k in args.draft_tokens.split(",")]
    args.ours_drafts = [name.strip() for name in args.ours_drafts.split(",")]
    result = measure(args)
    text = render(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
