"""How close quantized weights keep a model to its fp32 self: next-token agreement and KL divergence, teacher-forced.

For each real chat prompt, the fp32 model's own greedy continuation (``--new-tokens``) is the text; every weight
format then reads that text in one forward, and at each continuation position we compare its next-token distribution
with fp32's: the share of positions whose argmax is fp32's, and the mean ``KL(fp32 || format)`` in nats. Formats:
``weights="int4"`` (ours: Q4_K where a row holds a multiple of 256 values, else Q4_1), the same with Q4_1 everywhere
(gguf-py's quantizer) and ``weights="int8"`` (per-channel, bf16 activations). A provisioned model's fp32 folder is its
GGUF file dequantized (the exact GGUF mode computes it), so here the formats are measured against that file's model.
Usage::

    python benchmarks/quantized_quality.py --model qwen2.5-coder-1.5b-instruct --out docs/benchmarks-gguf.md
"""

from __future__ import annotations

import argparse
import sys

import torch


def _q4_1_everywhere(folder: str):
    """The int4 model with every matrix in Q4_1 (the alternative ours was chosen against)."""
    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.backends.pytorch import int4_weights

    original = int4_weights.int4_block
    int4_weights.int4_block = lambda k: original(k) if k % 256 else int4_weights.Q4_1
    try:
        return IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int4")
    finally:
        int4_weights.int4_block = original


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", help="append the table to this markdown file (e.g. docs/benchmarks-gguf.md)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.prompts import chat_prompts
    from optimum_ipex_spec.provisioning.provision import resolve_model

    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts, starts = [], []
    with torch.no_grad():
        for prompt in chat_prompts(tokenizer, n=args.prompts):
            enc = tokenizer(prompt, return_tensors="pt")
            texts.append(dense.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False))
            starts.append(enc["input_ids"].shape[1] - 1)  # the logits that predict the first new token on
        reference = [dense(t).logits[0, s:-1].float().log_softmax(-1) for t, s in zip(texts, starts)]
    del dense
    formats = [("int4 (ours: Q4_K, Q4_1 where rows are not multiples of 256)",
                lambda: IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int4")),
               ("Q4_1 everywhere (gguf-py's quantizer)", lambda: _q4_1_everywhere(folder)),
               ("int8 (per-channel, bf16 activations)",
                lambda: IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int8"))]
    rows = []
    for name, load in formats:
        model = load()
        agree = total = 0
        kl = 0.0
        with torch.no_grad():
            for text, start, ref in zip(texts, starts, reference):
                got = model(text).logits[0, start:-1].float().log_softmax(-1)
                agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
                total += ref.shape[0]
                kl += float(torch.nn.functional.kl_div(got, ref, log_target=True, reduction="sum"))
        rows.append((name, agree / total, kl / total))
        print(f"{name}: agreement {agree / total:.3f}, KL {kl / total:.4f}", file=sys.stderr, flush=True)
        del model
    lines = [f"### Next-token agreement with fp32, {args.model}, {len(texts)} prompts x {args.new_tokens} tokens "
             "(teacher-forced on fp32's greedy text)", "",
             "| weights | argmax = fp32's | mean KL divergence from fp32, nats |",
             "|---|---|---|"]
    lines += [f"| {name} | {agree:.1%} | {abs(kl):.4f} |" for name, agree, kl in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
