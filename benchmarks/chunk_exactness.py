"""Probe (issue 46 item 8): does the compiled fp32 4-token verification graph give each row the 1-token graph's bits
on this machine, for which model shapes, and why not where it does not.

Two parts, on ``--threads`` threads (1 by default; the kernel's rounding depends on it):

1. SDPA's CPU kernel alone (eager, a second or two), one key/value head: per head size and query row count, whether
   every row of a call with that many query rows gets the bits it gets among 4 (``=``) or not (``x``). The kernel
   splits the query rows into blocks of 32 and multiplies each with MKL's sgemm (which may split a block's rows
   between threads); where a product of 1-3 rows rounds otherwise, a 1-token graph whose key/value heads each serve
   1-3 query heads (or 5-7 split in such pieces) differs from the 4-token graph.
2. Tiny seeded Llama models compiled in fp32 (``torch_compile=True``; tens of seconds each), their 4-token graph
   compiled and checked (``model.compile_chunk_step()``): ``chunk_exact`` and the kernel, with the step's query rows
   padded to a multiple of 4 where the kernel needs it
   (:func:`optimum_ipex_spec.backends.pytorch.compiled_step.attention_query_rows`, decided at load by
   :func:`~optimum_ipex_spec.backends.pytorch.compiled_step.attention_rows_round_alike`) and, with
   ``--without-padding``, never (the code before the fix).

Usage (torch-current lane)::

    python benchmarks/chunk_exactness.py                      # the SDPA table and the default shapes
    python benchmarks/chunk_exactness.py --without-padding    # the same shapes without the padding too
    python benchmarks/chunk_exactness.py --without-padding --threads 2
    python benchmarks/chunk_exactness.py --shapes 64x4x2x2x512 576x9x3x1x512 --skip-sdpa

A shape is ``hidden x heads x kv_heads x layers x vocab``. ``--time`` instead loads each shape (and ``--model``, a
model folder such as SmolLM2-135M's), compiles a second step over its packed weights without the padding, and times
a decode step and a 4-token verification of each on a cache of ``--context`` tokens, the two interleaved (each first
in half the rounds), median over ``--rounds``::

    python benchmarks/chunk_exactness.py --skip-sdpa --shapes 64x4x2x2x512 --time \
        --model ~/.cache/optimum_ipex_spec/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import logging
import time

#: 2, 1, 4, 8, 3 (SmolLM2's heads and head size) and 7 (one key/value head) query heads per key/value head
DEFAULT_SHAPES = ["64x4x2x2x512", "64x4x4x1x512", "128x8x2x1x512", "256x8x1x1x512", "576x9x3x1x512", "448x7x1x1x512"]


def sdpa_rows_table(head_dims=(16, 64, 128), keys=(15, 511), max_rows=40) -> None:
    """Print, per head size and key count, one character per query row count 1..max_rows (one key/value head): ``=``
    when every row of that call gets the bits it gets in a call of 4 copies of it, ``x`` otherwise."""
    import torch

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    print(f"SDPA's CPU kernel, fp32: query rows 1..{max_rows} against each row among 4 (=: same bits)")
    for dim in head_dims:
        for n in keys:
            gen = torch.Generator().manual_seed(dim * 1000 + n)
            q = torch.randn(1, 1, max_rows, dim, generator=gen)
            k, v = torch.randn(2, 1, 1, n, dim, generator=gen)
            mask = torch.zeros(1, 1, max_rows, n)
            for r in range(max_rows):
                mask[..., r, n - 1 - r % 5:] = float("-inf")

            def run(rows_q, rows_mask):
                return op(rows_q, k, v, 0.0, False, attn_mask=rows_mask, scale=dim ** -0.5)[0]

            alone = torch.cat([run(q[:, :, r:r + 1].repeat(1, 1, 4, 1), mask[:, :, r:r + 1].repeat(1, 1, 4, 1))[
                :, :, :1] for r in range(max_rows)], dim=2)
            marks = "".join("=" if torch.equal(run(q[:, :, :rows], mask[:, :, :rows]), alone[:, :, :rows]) else "x"
                            for rows in range(1, max_rows + 1))
            print(f"  head {dim:4d}, {n:4d} keys: {marks}")


def build(hidden: int, heads: int, kv_heads: int, layers: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, max_position_embeddings=4096,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2))
    model.config.architectures = ["LlamaForCausalLM"]
    return model.eval()


def load(what: str, padding: bool):
    """``(model, seconds)``: a shape (``hidden x heads x kv x layers x vocab``) or a model folder, fp32, compiled, its
    4-token graph compiled and checked; without ``padding`` the graphs are traced as before the fix."""
    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.backends.pytorch import compiled_step

    original = compiled_step.attention_query_rows
    if not padding:
        compiled_step.attention_query_rows = lambda rows: rows
    try:
        start = time.perf_counter()
        if "x" in what and not what.startswith(("/", ".", "~")):
            hidden, heads, kv_heads, layers, vocab = (int(x) for x in what.split("x"))
            model = IPEXModelForCausalLM.from_transformers_model(build(hidden, heads, kv_heads, layers, vocab),
                                                                 backend="torch", torch_compile=True)
        else:
            import os

            import torch

            model = IPEXModelForCausalLM.from_pretrained(os.path.expanduser(what), export=True, backend="torch",
                                                         torch_dtype=torch.float32, torch_compile=True)
        model.compile_chunk_step()
        return model, time.perf_counter() - start
    finally:
        compiled_step.attention_query_rows = original


def time_steps(what: str, context: int, rounds: int) -> None:
    """Print the median ms of a decode step and of a 4-token verification, with and without the padding: one model
    (padded, as loaded) and a second compiled step over the same packed weights traced without the padding, so that
    only the graphs differ; their calls interleaved, each first in half the rounds, each call on a cache of
    ``context`` tokens cropped back after it."""
    import statistics

    import torch

    from optimum_ipex_spec.backends.pytorch import compiled_step

    model, _ = load(what, True)
    steps = {True: model.runner.step}
    original = compiled_step.attention_query_rows
    compiled_step.attention_query_rows = lambda rows: rows
    try:
        steps[False] = compiled_step.CompiledDecodeStep(model.runner.decoder)  # the same packed modules
        steps[False].compile()
        steps[False].compile_chunk()
    finally:
        compiled_step.attention_query_rows = original
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, context + 4), generator=torch.Generator().manual_seed(0))
    caches = {}
    for padding in steps:
        caches[padding] = model.runner.new_cache(1, context + 64)
        model(ids[:, :context], past_key_values=caches[padding])  # the prefill, on the eager decoder
    times = {(padding, rows): [] for padding in steps for rows in (1, 4)}
    with torch.no_grad():
        for round_ in range(rounds):
            for rows in (1, 4):
                for padding in (False, True) if round_ % 2 else (True, False):
                    chunk = ids[:, context:context + rows]
                    start = time.perf_counter()
                    steps[padding](chunk, torch.arange(context, context + rows)[None], caches[padding])
                    times[padding, rows].append((time.perf_counter() - start) * 1e3)
                    caches[padding].crop(context)
    for padding in (False, True):
        step = steps[padding]
        padded = padding and step.module.pad_query_rows  # the unpadded step was traced with the padding off
        print(f"| {what} | {'yes' if padded else 'no'} | {step.chunk_exact} | "
              f"{1 if step.chunk_exact is False else compiled_step.CHUNK_ROWS} | "
              f"{statistics.median(times[padding, 1]):.3f} | {statistics.median(times[padding, 4]):.3f} |",
              flush=True)


def probe_shape(shape: str, padding: bool) -> dict:
    """Compile one shape's fp32 graphs (both) and check them; the row of the table."""
    from optimum_ipex_spec.backends.pytorch import compiled_step

    hidden, heads, kv_heads, layers, vocab = (int(x) for x in shape.split("x"))
    model, seconds = load(shape, padding)
    ready = model.runner.step is not None and model.runner.step.chunk_compile_seconds is not None
    step = model.runner.step
    group = heads // kv_heads
    padded = padding and step is not None and step.module.pad_query_rows  # where the kernel needs it
    return {"shape": shape, "head": hidden // heads, "group": group,
            "alike": compiled_step.attention_rows_round_alike(kv_heads, group, hidden // heads),
            "sdpa_rows": (compiled_step.attention_query_rows(group) if padded else group, 4 * group),
            "padding": padding, "ready": ready, "chunk_exact": None if step is None else step.chunk_exact,
            "kernel": None if step is None else step.kernel, "step_rows": None if step is None else step.step_rows,
            "verify_rows": model.runner.verify_rows, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES,
                        help="hidden x heads x kv_heads x layers x vocab (default: %(default)s; none: only --model)")
    parser.add_argument("--without-padding", action="store_true",
                        help="also compile each shape with the query-row padding off (the code before the fix)")
    parser.add_argument("--skip-sdpa", action="store_true", help="skip the SDPA kernel's table")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time", action="store_true",
                        help="instead of the exactness table, time a decode step and a 4-token verification with and "
                             "without the padding")
    parser.add_argument("--model", action="append", default=[], help="a model folder to time too (with --time)")
    parser.add_argument("--context", type=int, default=100, help="cached tokens of the timed calls")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)  # the step's fallback warning is the table's chunk_exact column
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    if not args.skip_sdpa:
        sdpa_rows_table()
    if args.time:  # the timing table says chunk_exact too; each shape compiles once per padding
        print(f"\n| model | query rows padded | chunk_exact | verify rows | decode step ms | 4-token verification ms "
              f"| (median of {args.rounds}, {args.context} tokens cached)")
        print("|---|---|---|---|---|---|")
        for what in args.shapes + args.model:
            time_steps(what, args.context, args.rounds)
        return
    print("\n| shape (hidden x heads x kv x layers x vocab) | head size | q heads per kv head | SDPA rows alike "
          "unpadded | padding | SDPA rows 1-token / 4-token | chunk_exact | kernel | step rows | verify rows | "
          "compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for padding in ((True, False) if args.without_padding else (True,)):
            row = probe_shape(shape, padding)
            one, four = row["sdpa_rows"]
            print(f"| {row['shape']} | {row['head']} | {row['group']} | {row['alike']} | "
                  f"{'where needed' if padding else 'off'} | {one} / {four} | {row['chunk_exact']} | {row['kernel']} | "
                  f"{row['step_rows']} | {row['verify_rows']} | {row['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
