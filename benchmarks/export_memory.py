"""Memory of one model, stock transformers vs our export, as figures next to the weight bytes (issue 14).

Each configuration runs in a fresh process (a process never returns freed memory reliably, so stages of one
process would blur), one thread. Reported in GB:

* ``weights``: bytes of the parameters in the requested dtype (embedding and a tied head counted once);
* ``load``: RSS after loading (stock ``from_pretrained``; ours ``from_pretrained(export=True)``) minus RSS
  after the imports; ``private``: the same for private memory (Private_Clean + Private_Dirty of
  ``/proc/self/smaps_rollup``: what is not a shared, file-backed page such as a memory-mapped safetensors file);
* ``steady``: RSS minus the imports' after 32 greedy tokens; ``peak``: the process's peak RSS (VmHWM) minus the
  imports' RSS; ``seconds``: the load (or export) time.

Usage (in a lane's environment; model names as everywhere)::

    python benchmarks/export_memory.py --model smollm2-135m-instruct --dtype float32 bfloat16

The issue-14 bounds to compare with: steady <= 1.25 x weights + 0.5 GB, peak <= 2 x weights + 1 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GB = 1 << 30


def _memory() -> dict:
    """RSS, peak RSS (VmHWM) and private bytes of this process, from /proc (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    private = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) * 1024
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"], "private": private}


def _measure(model_name: str, dtype_name: str, kind: str) -> dict:
    """One configuration, in this process: load, 32 greedy tokens, memory at each step."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provision import resolve_model

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    path = resolve_model(model_name)
    gc.collect()
    base = _memory()
    start = time.perf_counter()
    if kind == "stock":
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    else:
        model = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=dtype)
        with torch.device("meta"):
            shape = AutoModelForCausalLM.from_config(model.config, torch_dtype=dtype)
        weights = {id(p): p.numel() * p.element_size() for p in shape.parameters()}  # tied: one parameter
    seconds = time.perf_counter() - start
    gc.collect()
    loaded = _memory()
    ids = torch.arange(100, 132).unsqueeze(0)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    gc.collect()
    steady = _memory()
    return {
        "model": model_name, "dtype": dtype_name, "kind": kind, "seconds": round(seconds, 1),
        "weights": sum(weights.values()) / GB,
        "load": (loaded["rss"] - base["rss"]) / GB,
        "private": (loaded["private"] - base["private"]) / GB,
        "steady": (steady["rss"] - base["rss"]) / GB,
        "peak": (steady["peak"] - base["rss"]) / GB,
        "backend": getattr(model, "backend", "transformers"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="provisioned name, folder or hub id")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--kinds", nargs="+", default=["stock", "ours"], choices=["stock", "ours"])
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "DTYPE", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # the child process: print one JSON line
        print(json.dumps(_measure(*args.one)))
        return 0
    print("| model | dtype | kind | backend | weights GB | load GB | private GB | steady GB | peak GB | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for kind in args.kinds:
            proc = subprocess.run([sys.executable, __file__, "--one", args.model, dtype, kind],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"| {args.model} | {dtype} | {kind} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"| {r['model']} | {r['dtype']} | {r['kind']} | {r['backend']} | {r['weights']:.2f} | {r['load']:.2f} | "
                  f"{r['private']:.2f} | {r['steady']:.2f} | {r['peak']:.2f} | {r['seconds']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
