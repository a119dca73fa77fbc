"""Peak RSS of a short answer on the pure-PyTorch path for several ``max_new_tokens`` (issue 46: the KV cache's memory
follows the tokens generated, not ``max_new_tokens``).

Each value runs in a fresh process (peak RSS is per process): SmolLM2-135M-Instruct fp32 exported with
``backend="torch"``, 1 thread, a short prompt, greedy, stopped after ``--answer`` new tokens by a stopping criterion;
prints the peak RSS (``ru_maxrss``) before and after ``generate()``.

    python benchmarks/cache_memory.py [--max-new-tokens 16 4000000] [--answer 5]

Before issue 46 the cache was allocated for prompt + ``max_new_tokens`` up front: 4,000,000 ran out of memory.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def _one(max_new_tokens: int, answer: int) -> str:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.provision import provision

    class StopAfter(StoppingCriteria):
        def __init__(self, start: int):
            self.start = start

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.start >= answer, dtype=torch.bool)

    torch.set_num_threads(1)
    model = IPEXModelForCausalLM.from_pretrained(str(provision("smollm2-135m-instruct")), export=True, backend="torch")
    ids = torch.tensor([[1, 504, 3458, 282, 253, 1345, 30, 2]])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1])]))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"| {max_new_tokens} | {out.shape[1] - ids.shape[1]} | {before:.0f} | {after:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[16, 4_000_000])
    parser.add_argument("--answer", type=int, default=5, help="new tokens before the stopping criterion stops")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process's value
    args = parser.parse_args()
    if args.one is not None:
        print(_one(args.one, args.answer), flush=True)
        return
    print("| max_new_tokens | new tokens | peak RSS before generate (MiB) | peak RSS after (MiB) |")
    print("|---|---|---|---|", flush=True)
    for value in args.max_new_tokens:
        done = subprocess.run([sys.executable, __file__, "--one", str(value), "--answer", str(args.answer)],
                              capture_output=True, text=True)
        rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
        print(rows[-1] if done.returncode == 0 and rows else
              f"| {value} | - | - | exit status {done.returncode} (-9: killed, e.g. out of memory) |", flush=True)


if __name__ == "__main__":
    main()
