"""What verifying k draft tokens costs the target, against one decode step.

For an exported model (default SmolLM2-135M), 1 thread: prefill a cache of ``--past`` random tokens once, then
in each of ``--rounds`` rounds run, interleaved, a forward of k tokens on that cache for every k (the cache is
cropped back after each). Prints the median milliseconds per k and the ratio to k = 1 (the decode graph; k > 1
runs the exact verify graph). The machine's noise moves the milliseconds; the ratios are the result.

    python benchmarks/verify_cost.py [--model smollm2-135m-instruct] [--dtype float32] [--past 300] [--backend auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def chunk_forward_s(model, past, chunks, rounds):
    """Seconds of ``model``'s forward over ``n`` random tokens on a cache of ``past`` random ones, for each ``n``
    in ``chunks``: ``({n: [seconds of each round]}, seconds of the prefill of the cache)``. The lengths are
    interleaved within each round and the cache is cropped back to ``past`` before every forward."""
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    times = {n: [] for n in chunks}
    with torch.no_grad():
        start = time.perf_counter()
        cache = model(torch.randint(0, vocab, (1, past), generator=generator)).past_key_values
        prefill_s = time.perf_counter() - start
        for _ in range(rounds):
            for n in chunks:
                cache.crop(past)
                ids = torch.randint(0, vocab, (1, n), generator=generator)
                start = time.perf_counter()
                model(ids, past_key_values=cache)
                times[n].append(time.perf_counter() - start)
    return times, prefill_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model id, name or export folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--past", type=int, default=300, help="cached tokens before each forward")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 5, 9, 12, 16], help="chunk lengths")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="auto", choices=["auto", "ipex", "torch"],
                        help="runtime of the export (auto: IPEX where installed)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from optimum_ipex_spec import IPEXModelForCausalLM

    model = IPEXModelForCausalLM.from_pretrained(args.model, export=True, torch_dtype=getattr(torch, args.dtype),
                                                 backend=args.backend)
    times, _ = chunk_forward_s(model, args.past, args.k, args.rounds)
    one = statistics.median(times[min(args.k)])
    print(f"{args.model} {args.dtype}, {model.backend} backend, cache of {args.past} tokens, 1 thread, "
          f"median of {args.rounds}")
    print("| k | ms | x one-token decode |\n|---|---|---|")
    for k, values in times.items():
        median = statistics.median(values)
        print(f"| {k} | {1e3 * median:.1f} | {median / one:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
