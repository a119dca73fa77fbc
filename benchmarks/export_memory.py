"""Memory of one model, stock transformers vs our export, as figures next to the weight bytes (issue 14).

Each configuration runs in a fresh process (a process never returns freed memory reliably, so stages of one
process would blur), one thread. Reported in GB:

* ``weights``: bytes of the parameters in the requested dtype (embedding and a tied head counted once);
* ``load``: RSS after loading (stock ``from_pretrained``; ours ``from_pretrained(export=True)``) minus RSS
  after the imports (IPEX's included, for ours); ``private``: the same for private memory (Private_Clean + Private_Dirty
  of ``/proc/self/smaps_rollup``: what is not a shared, file-backed page such as a memory-mapped safetensors file);
* ``steady``: RSS minus the imports' after 32 greedy tokens; ``peak``: the process's peak RSS (VmHWM) minus the
  imports' RSS; ``seconds``: the load (or export) time.

Kinds: ``stock`` (transformers ``from_pretrained``), ``ours`` (``from_pretrained(export=True)``), ``saved`` (our
``from_pretrained`` of a folder ``save_pretrained`` wrote, in a process of its own before; the saving process is
not measured), ``compiled`` (the pure-PyTorch path with ``torch_compile=True``, both graphs compiled:
``compile_chunk_step()`` in the load; Inductor itself, about 0.06 GB, is loaded by a trivial ``torch.compile``
before the baseline, a cost of the process).

Usage (in a lane's environment; model names as everywhere)::

    python benchmarks/export_memory.py --model smollm2-135m-instruct --dtype float32 bfloat16

The issue-14 bounds to compare with: steady <= 1.25 x weights + 0.5 GB, peak <= 2 x weights + 1 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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


def _save(model_name: str, dtype_name: str, folder: str) -> None:
    """Export and save (the ``saved`` kind's folder), in a process of its own."""
    import torch

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.provision import resolve_model

    torch.set_num_threads(1)
    IPEXModelForCausalLM.from_pretrained(resolve_model(model_name), export=True,
                                         torch_dtype=getattr(torch, dtype_name)).save_pretrained(folder)


def _measure(model_name: str, dtype_name: str, kind: str, folder: str = "") -> dict:
    """One configuration, in this process: load, 32 greedy tokens, memory at each step."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.provisioning.provision import resolve_model

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    path = resolve_model(model_name)
    if kind != "stock":
        # IPEX's libraries (~0.3 GB RSS) are a cost of the process, not of the model: imported before the baseline
        from optimum_ipex_spec.utils.import_utils import ipex_status

        ipex_status()
    if kind == "compiled":  # Inductor's own code and state, once per process: before the baseline too
        torch.compile(lambda x: x + 1)(torch.ones(2))
    gc.collect()
    base = _memory()
    start = time.perf_counter()
    if kind == "stock":
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    else:
        if kind == "saved":
            model = IPEXModelForCausalLM.from_pretrained(folder)
        elif kind == "compiled":
            model = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=dtype, backend="torch",
                                                         torch_compile=True)
            model.compile_chunk_step()
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
    parser.add_argument("--kinds", nargs="+", default=["stock", "ours", "saved"], choices=["stock", "ours", "saved", "compiled"])
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "DTYPE", "KIND", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--save", nargs=3, metavar=("MODEL", "DTYPE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # the child process: print one JSON line
        print(json.dumps(_measure(*args.one)))
        return 0
    if args.save:
        _save(*args.save)
        return 0
    print("| model | dtype | kind | backend | weights GB | load GB | private GB | steady GB | peak GB | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for kind in args.kinds:
            with tempfile.TemporaryDirectory(prefix="export-memory-") as folder:
                proc = None
                if kind == "saved":
                    proc = subprocess.run([sys.executable, __file__, "--save", args.model, dtype, folder],
                                          capture_output=True, text=True)
                if proc is None or proc.returncode == 0:
                    proc = subprocess.run([sys.executable, __file__, "--one", args.model, dtype, kind, folder],
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
