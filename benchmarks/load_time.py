"""Load time of a saved export against stock transformers' ``from_pretrained`` of the same checkpoint (issue 47).

Each measurement runs in a fresh process (imports are not timed), the kinds interleaved round by round, medians
reported; the page cache is warm for every kind (each file was read before the first round). Kinds:

* ``stock``: ``AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=...)`` (safetensors, memory-mapped);
* ``read``: reading every byte of the saved export's weight files once (the cost of touching the weights, which
  a memory-mapped stock load defers: the "time to map the weights" of the bound);
* ``export``: ``IPEXModelForCausalLM.from_pretrained(checkpoint, export=True, torch_dtype=..., backend=...)``;
* ``first``: ``IPEXModelForCausalLM.from_pretrained(folder)`` of the folder ``save_pretrained`` wrote (in a process of
  its own, before the rounds), as on a machine that never loaded it: the manifest check with its sha256 pass
  (this machine's records of verified files removed first, untimed) and, for IPEX, the graphs traced again;
* ``saved``: the same load again, the files recorded as verified by an earlier load (no sha256 pass);
* ``archive`` (IPEX only): ``torch.jit.load`` of the same two graphs saved as a TorchScript archive, what a local
  cache of traced graphs would load instead of tracing again (not something the package does; measured to decide).

The bounds to compare with: ``saved`` <= 2 x ``stock`` + ``read``; ``first`` <= ``export``. The records of verified
files go to a temporary ``OPTIMUM_IPEX_SPEC_CACHE`` of the run (models are resolved before it is set).

Usage (in a lane's environment)::

    python benchmarks/load_time.py --model smollm2-135m-instruct --dtype float32 --backend torch ipex --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _one(kind: str, model_name: str, dtype_name: str, backend: str, folder: str) -> float:
    """One load, in this process; returns seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.loading.manifest import VERIFIED_DIR_NAME
    from optimum_ipex_spec.provisioning.provision import CACHE_ENV, resolve_model
    from optimum_ipex_spec.utils.import_utils import ipex_status

    ipex_status()  # IPEX's import, a cost of the process
    dtype = getattr(torch, dtype_name)
    path = resolve_model(model_name)
    if kind in ("first", "saved"):  # the run's own records of verified files, beside the export
        os.environ[CACHE_ENV] = os.path.join(os.path.dirname(folder.rstrip("/")), "cache")
    if kind == "first":
        shutil.rmtree(os.path.join(os.environ[CACHE_ENV], VERIFIED_DIR_NAME), ignore_errors=True)
    start = time.perf_counter()
    if kind == "stock":
        AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    elif kind == "read":
        buffer = bytearray(8 << 20)
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                with open(os.path.join(folder, name), "rb", buffering=0) as f:
                    while f.readinto(buffer):
                        pass
    elif kind == "export":
        IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=dtype, backend=backend)
    elif kind in ("first", "saved"):
        model = IPEXModelForCausalLM.from_pretrained(folder)
        assert model.backend == backend, (model.backend, backend)
    elif kind == "archive":
        from optimum_ipex_spec.backends.ipex.export import load_ipex_graphs

        load_ipex_graphs(os.path.join(folder, "graphs.pt"))
    else:
        raise ValueError(kind)
    return time.perf_counter() - start


def _prepare(model_name: str, dtype_name: str, backend: str, folder: str, archive: str) -> None:
    """Export and save into ``folder``; for IPEX also write the graphs as an archive into ``archive``."""
    import torch

    from optimum_ipex_spec import IPEXModelForCausalLM
    from optimum_ipex_spec.backends.ipex.export import IPEXGraphs, save_ipex_graphs
    from optimum_ipex_spec.provisioning.provision import resolve_model

    model = IPEXModelForCausalLM.from_pretrained(resolve_model(model_name), export=True,
                                                 torch_dtype=getattr(torch, dtype_name), backend=backend)
    model.save_pretrained(folder)
    if backend == "ipex":
        save_ipex_graphs(IPEXGraphs(model.model, model.verify_model), os.path.join(archive, "graphs.pt"))


def _child(args) -> float:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{args}: {proc.stderr.strip().splitlines()[-1]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="provisioned name, folder or hub id")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--backend", nargs="+", default=["torch"], choices=["torch", "ipex"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="append the results to this JSON-lines file")
    parser.add_argument("--out", default=None, help="append the table's rows to this markdown file (header once)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(_one(*args.child))
        return 0
    if args.prepare:
        _prepare(*args.prepare)
        return 0
    header = ("| model | dtype | backend | stock s | read s | saved s | saved / stock | bound 2 x stock + read s | "
              "first s | export s | archive s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    print(header)
    if args.out and not os.path.exists(args.out):
        with open(args.out, "w") as f:
            f.write(header + "\n")
    for dtype in args.dtype:
        for backend in args.backend:
            with tempfile.TemporaryDirectory(prefix="load-time-") as work:
                folder, archive = os.path.join(work, "export"), work
                proc = subprocess.run([sys.executable, __file__, "--prepare", args.model, dtype, backend, folder,
                                       archive], capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"| {args.model} | {dtype} | {backend} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                    continue
                kinds = ["stock", "read", "first", "saved", "export"] + (["archive"] if backend == "ipex" else [])
                times = {kind: [] for kind in kinds}
                for kind in kinds:  # a first, untimed pass: every file in the page cache
                    _child([kind, args.model, dtype, backend, folder if kind != "archive" else archive])
                for _ in range(args.rounds):
                    for kind in kinds:
                        times[kind].append(_child([kind, args.model, dtype, backend,
                                                   folder if kind != "archive" else archive]))
            med = {kind: statistics.median(values) for kind, values in times.items()}
            row = {"model": args.model, "dtype": dtype, "backend": backend, "rounds": args.rounds, **med,
                   "samples": times}
            archive_s = f"{med['archive']:.1f}" if "archive" in med else "-"
            line = (f"| {args.model} | {dtype} | {backend} | {med['stock']:.2f} | {med['read']:.2f} | "
                    f"{med['saved']:.2f} | "
                    f"x{med['saved'] / med['stock']:.2f} | {2 * med['stock'] + med['read']:.2f} | {med['first']:.2f} | "
                    f"{med['export']:.1f} | {archive_s} |")
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
