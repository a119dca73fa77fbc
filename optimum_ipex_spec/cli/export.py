"""The work behind ``optimum-cli export ipex``: export, save, reload and validate.

Export uses the same code path as ``IPEXModelForCausalLM.from_pretrained(..., export=True)``. The
folder is written to a temporary sibling and moved into place only when export and saving succeeded,
so an error leaves no partial output. Validation reloads the saved folder (no re-export) and compares
its logits with the eager transformers model on sample inputs: a prefill, one decode step on the
cache and a chunk of tokens on the cache (the speculative verification path).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..loading.export_folder import carry_over, foreign_files, has_export
from ..facts import EXPORT_CONFIG_NAME, TASKS, check_causal_lm_config
from ..loading.manifest import write_manifest
from ..utils.fs import looks_like_local_path, staged_directory

logger = logging.getLogger("optimum_ipex_spec")

#: Defaults for the max |logit difference| against the eager fp32 model. fp32: measured 7.5e-5 on
#: SmolLM2 (logits of magnitude ~30). bf16 keeps 8 mantissa bits, so a logit near 30 is only resolved
#: to 0.125 and 30 layers of bf16 rounding add up: measured 0.72 on SmolLM2, 0.02 on tiny models.
# fp32 differs from eager transformers only by summation order: SmolLM2 (30 layers) measured 7.5e-5 with IPEX,
# 1.6e-4 on the PyTorch path (fused QKV / gate-up products). bf16: see docs/export-cli.md.
DEFAULT_ATOL = {"float32": 5e-4, "bfloat16": 1.5}
SAMPLE_TEXTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The history of the printing press begins in",
    "Question: what is 17 times 3? Answer:",
)


class ExportError(RuntimeError):
    """A problem with the inputs of an export (path, task, model type, output folder, IPEX)."""


@dataclass
class ValidationReport:
    """Outcome of validating a saved export.

    Attributes:
        max_abs_diff: largest |logit difference| between the reloaded export and the eager model.
        atol: the tolerance it was compared with.
        passed: ``max_abs_diff <= atol``.
        backend: backend of the reloaded export ("ipex" or "torch").
        checks: one line per sample input and forward kind.
        dtype: dtype of the reloaded export ("float32" or "bfloat16").
    """

    max_abs_diff: float
    atol: float
    passed: bool
    backend: str
    checks: List[str] = field(default_factory=list)
    dtype: str = "float32"


def infer_task(config) -> str:
    check_causal_lm_config(config, getattr(config, "_name_or_path", "model"))
    return "text-generation-with-past"


def _check_output(output: Path, overwrite: bool, model_id: str) -> None:
    """Refuse an output that the export would wrongly replace (the output folder is replaced whole)."""
    source = Path(model_id).expanduser()
    if source.exists():
        source = source.resolve()
        real = output.resolve()
        if real == source or real in source.parents:
            raise ExportError(
                f"output {output} is the model folder or contains it: --overwrite would delete the checkpoint being "
                "exported; choose another output folder"
            )
    if output.is_symlink():
        raise ExportError(f"output {output} is a symbolic link (to {output.resolve()}); the export replaces the "
                          "folder it names: pass a real folder path")
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if output.resolve() in (cwd, home, Path(output.anchor)) or output.resolve() in cwd.parents:
        raise ExportError(f"output {output} is the working directory, one of its parents, the home folder or the "
                          "root: the export replaces its output folder whole; pass a new folder, e.g. ./exported")
    if output.exists() and not output.is_dir():
        raise ExportError(f"output {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise ExportError(f"output folder {output} is not empty; pass --overwrite to replace it")
        if not has_export(str(output)):
            raise ExportError(f"output folder {output} is not empty and holds no export of ours ({EXPORT_CONFIG_NAME} "
                              "missing): --overwrite replaces only an earlier export or an empty folder; choose "
                              "another output folder or empty this one yourself")
        others = foreign_files(str(output))
        if others:
            raise ExportError(f"output folder {output} holds an export and files of yours ({', '.join(others[:5])}): "
                              "--overwrite would delete them (a tokenizer, docs and subfolders are kept); move them "
                              "first, or choose another output folder")


def _load_config(model_id: str, **hub):
    from transformers import AutoConfig

    if looks_like_local_path(model_id) and not os.path.isdir(model_id):
        raise ExportError(f"model folder {model_id} does not exist")
    try:
        return AutoConfig.from_pretrained(model_id, **hub)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load a model config from {model_id}: {exc}") from exc


def main_export(
    model: str,
    output: str,
    task: str = "auto",
    torch_dtype: str = "float32",
    backend: str = "auto",
    with_draft: bool = False,
    atol: Optional[float] = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    local_files_only: bool = False,
) -> ValidationReport:
    """Export ``model`` to ``output`` and validate it; print a report.

    Raises:
        ExportError: missing model path, non-causal model, unsupported task, non-empty output without
            ``overwrite``, or ``backend="ipex"`` without a usable IPEX.
    """
    from tqdm.auto import tqdm

    from ..modeling import IPEXModelForCausalLM
    from ..provisioning.provision import resolve_model
    from ..utils.import_utils import IPEXNotAvailableError

    output_path = Path(os.path.abspath(Path(output).expanduser()))  # links not followed: _check_output refuses them
    if task != "auto" and task not in TASKS:
        raise ExportError(f"task {task!r} is not supported by the IPEX exporter; supported: {', '.join(TASKS)}")
    if atol is not None and not atol >= 0:  # also rejects NaN
        raise ExportError(f"--atol must be a non-negative number, got {atol}")
    model_id = resolve_model(model)
    _check_output(output_path, overwrite, model_id)
    hub = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
               trust_remote_code=trust_remote_code)
    config = _load_config(model_id, **hub)
    try:
        task = infer_task(config) if task == "auto" else (infer_task(config) and task)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc

    try:
        output_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot write to {output_path.parent}: {exc}") from exc
    steps = tqdm(total=4 + (2 if with_draft else 0), desc="export ipex", unit="step")
    kept = []
    with staged_directory(output_path, honour_umask=True, keep=kept) as staging:
        steps.set_postfix_str("loading and exporting")
        try:
            exported = IPEXModelForCausalLM.from_pretrained(
                model_id, export=True, torch_dtype=torch_dtype, backend=backend, **hub
            )
        except (IPEXNotAvailableError, FileNotFoundError, ValueError) as exc:
            raise ExportError(str(exc)) from exc
        steps.update(1)
        steps.set_postfix_str("saving")
        exported.save_pretrained(staging)
        tokenizer = _save_tokenizer(model_id, staging, hub)
        steps.update(1)
        if with_draft:
            steps.set_postfix_str("exporting the bf16 draft")
            draft = exported.self_draft(torch_dtype="bfloat16", backend=backend)
            draft.save_pretrained(staging / "draft-bf16")
            steps.update(1)
        del exported
        kept += carry_over(str(output_path), str(staging), skip=("draft-bf16",))  # an earlier export's README, ...
        write_manifest(str(staging))  # the tokenizer's files listed too
    steps.set_postfix_str("validating")
    report = validate_export(output_path, model_id, tokenizer, atol, hub)
    steps.update(2)
    reports = [(output_path, report)]
    if with_draft:
        reports.append((output_path / "draft-bf16", validate_export(output_path / "draft-bf16", model_id, tokenizer,
                                                                     atol, hub)))
        steps.update(1)
    steps.close()
    for folder, folder_report in reports:
        _print_report(folder, task, folder_report)
    report.passed = all(r.passed for _, r in reports)
    return report


def _cache_of(output):
    """The cache of a forward's output: ``cache`` in transformers >= 5, ``past_key_values`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _save_tokenizer(model_id: str, folder: Path, hub: dict):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **hub)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        # ImportError: transformers 4.53 reports a folder without tokenizer files as "requires protobuf"
        logger.warning("no tokenizer saved (%s): validation uses random token ids", exc)
        return None
    if any(len(tokenizer(text).input_ids) < 6 for text in SAMPLE_TEXTS):
        # transformers 5 builds an empty tokenizer for a folder without tokenizer files instead of raising
        logger.warning("no usable tokenizer in %s (it encodes the sample texts to almost nothing): validation "
                       "uses random token ids", model_id)
        return None
    tokenizer.save_pretrained(folder)
    return tokenizer


def _sample_inputs(tokenizer, vocab_size: int):
    import torch

    if tokenizer is not None:
        return [tokenizer(text, return_tensors="pt").input_ids for text in SAMPLE_TEXTS]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (1, n), generator=generator) for n in (9, 17, 33)]


def validate_export(folder: Path, model_id: str, tokenizer, atol: Optional[float], hub: dict) -> ValidationReport:
    """Reload ``folder`` and compare its logits with the eager fp32 model on prefill, a decode step
    and a 4-token chunk on the cache. ``atol`` None: the default for the export's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..modeling import IPEXModelForCausalLM

    reloaded = IPEXModelForCausalLM.from_pretrained(folder)
    dtype = str(reloaded.dtype).replace("torch.", "")
    atol = DEFAULT_ATOL[dtype] if atol is None else atol
    eager = AutoModelForCausalLM.from_pretrained(model_id, torch_dtype=torch.float32, **hub).eval()
    worst, checks = 0.0, []
    with torch.no_grad():
        for ids in _sample_inputs(tokenizer, eager.config.vocab_size):
            full = eager(ids).logits
            n = ids.shape[1]
            split = n - 5  # prefill n-5 tokens, decode 1, then a chunk of 4 on the cache
            out = reloaded(ids[:, :split])
            diffs = {"prefill": (out.logits.float() - full[:, :split]).abs().max().item()}
            step = reloaded(ids[:, split : split + 1], past_key_values=_cache_of(out))
            diffs["decode"] = (step.logits.float() - full[:, split : split + 1]).abs().max().item()
            chunk = reloaded(ids[:, split + 1 :], past_key_values=_cache_of(step))
            diffs["chunk on cache"] = (chunk.logits.float() - full[:, split + 1 :]).abs().max().item()
            worst = max(worst, *diffs.values())
            checks.append(f"{n:3d} tokens: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    return ValidationReport(worst, atol, worst <= atol, reloaded.backend, checks, dtype)


def _print_report(output: Path, task: str, report: ValidationReport) -> None:
    print(f"Exported to {output} (task {task}, {report.dtype}, backend {report.backend})")
    for line in report.checks:
        print(f"  max |logit diff| vs eager transformers, {line}")
    relation, verdict = ("<=", "PASS") if report.passed else (">", "FAIL")
    print(f"Validation: max |logit diff| {report.max_abs_diff:.3e} {relation} atol {report.atol:g}: {verdict}")
