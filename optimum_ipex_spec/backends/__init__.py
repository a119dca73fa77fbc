"""Runners: one per runtime, behind one small interface (:class:`~optimum_ipex_spec.backends.base.Runner`),
chosen once per model by :func:`make_runner`."""

from __future__ import annotations

from typing import Optional

from ..facts import LLAMA_FAMILY_ARCHITECTURES
from .pytorch.decoder import TorchCausalLMDecoder
from .pytorch.compiled_step import check_torch_compile, check_torch_compile_flag
from .base import Runner
from .eager import EagerRunner, log_eager_once
from .ipex.runner import IPEXGraphRunner
from .pytorch.runner import TorchDecoderRunner

__all__ = ["Runner", "EagerRunner", "IPEXGraphRunner", "TorchDecoderRunner", "make_runner"]


def make_runner(backend: str, model, config, dtype, verify_model: Optional[object] = None,
                weights: str = "dense", torch_compile: bool = False) -> Runner:
    """The runner for ``model``: IPEX's graphs (``backend="ipex"``; ``model`` is the decode graph), else our
    pure-PyTorch decoder where it supports the architecture (holding its weights as ``weights`` says), else
    transformers' forward (logged once).

    Raises:
        ValueError: ``backend`` other than "ipex" / "torch"; ``weights="int8"`` with the IPEX backend or an
            architecture our decoder does not run; ``torch_compile=True`` with anything but our decoder on a bf16
            model (``compiled_step.check_torch_compile``), or not a bool.
    """
    check_torch_compile_flag(torch_compile)
    if torch_compile:
        check_torch_compile(backend, model, dtype, weights)
    if weights != "dense" and (backend != "torch" or not TorchCausalLMDecoder.supports(model)):
        raise ValueError(f"weights={weights!r} runs on our pure-PyTorch decoder (backend='torch', "
                         f"{', '.join(LLAMA_FAMILY_ARCHITECTURES)}); got backend={backend!r}, "
                         f"{type(model).__name__}")
    if backend == "ipex":
        return IPEXGraphRunner(model, verify_model, config, dtype)
    if backend != "torch":
        raise ValueError(f"backend must be 'ipex' or 'torch', got {backend!r}")
    if TorchCausalLMDecoder.supports(model):
        return TorchDecoderRunner(model, dtype, weights, torch_compile=torch_compile)
    log_eager_once(type(model).__name__, ", ".join(LLAMA_FAMILY_ARCHITECTURES))
    return EagerRunner(model)
