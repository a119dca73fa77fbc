"""Shared by the example scripts: one thread, a chat prompt, and the comparison every example prints.

`compare()` runs the target alone and then with a speculation strategy on the same input (greedy),
and prints tokens/s of both, their ratio, the acceptance counters where the strategy reports them,
and one line that starts with "output:" and says whether the two outputs are token-identical.
"""

import time

import torch


def setup(threads: int = 1) -> None:
    """One thread: stable timings on shared, noisy cores (two threads stall under outside load)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def chat(tokenizer, message: str):
    """``message`` as a one-turn chat, tokenized (``return_tensors="pt"``)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                           add_generation_prompt=True)
    return tokenizer(prompt, return_tensors="pt", add_special_tokens=False)


def timed(model, inputs, **kwargs):
    """(output ids, seconds) of one ``model.generate(**inputs, **kwargs)``."""
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs)
    return out, time.perf_counter() - start


def compare(target, inputs, text_tokenizer, label, max_new_tokens=64, stats=None, **speculation):
    """Run ``target`` alone and with ``**speculation`` (e.g. ``assistant_model=draft``); print the comparison.

    Args:
        text_tokenizer: decodes the output for printing.
        stats: a callable returning the strategy's counters after the run (an object with ``proposed``,
            ``accepted`` and, optionally, ``rounds``), or None when the strategy reports none.

    Returns:
        True when the outputs are token-identical.
    """
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    target.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up (first call compiles / allocates)
    alone, alone_s = timed(target, inputs, **gen)
    spec, spec_s = timed(target, inputs, **gen, **speculation)
    n = inputs["input_ids"].shape[1]
    alone_new, spec_new = alone[0, n:], spec[0, n:]
    print(text_tokenizer.decode(spec_new, skip_special_tokens=True).strip())
    print()
    alone_rate, spec_rate = len(alone_new) / alone_s, len(spec_new) / spec_s
    print(f"target alone:    {alone_rate:6.1f} tok/s ({len(alone_new)} new tokens in {alone_s:.2f} s)")
    print(f"{label + ':':16s} {spec_rate:6.1f} tok/s ({len(spec_new)} new tokens in {spec_s:.2f} s), "
          f"x{alone_s / spec_s:.2f} vs the target alone (end to end, prefill included)")
    counters = stats() if stats is not None else None
    if counters is not None and counters.proposed:
        line = f"acceptance:      {counters.accepted}/{counters.proposed} proposed tokens accepted " \
               f"({counters.accepted / counters.proposed:.1%})"
        rounds = getattr(counters, "rounds", 0)
        if rounds:
            line += f", {(counters.accepted + rounds) / rounds:.2f} tokens per target forward over {rounds} rounds"
        print(line)
    elif counters is not None:
        print("acceptance:      nothing proposed")
    else:
        print("acceptance:      not reported by this strategy")
    same = torch.equal(alone, spec)
    print(f"output: {'token-identical' if same else 'DIFFERENT'} to the target alone")
    return same
