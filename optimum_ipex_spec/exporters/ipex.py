"""Export a transformers causal LM to IPEX: fused kernels + fused KV cache, traced and frozen.

The export is ``ipex.llm.optimize(model, dtype, deployment_mode=True)``, which swaps the attention,
MLP, RMSNorm and RoPE modules for IPEX's fused ones and TorchScript-traces + freezes the forward.
We keep only the frozen graph (``torch.jit.ScriptModule``); weights live inside it as constants.

Graph signature (keyword arguments, as traced by IPEX):
    input_ids       int64 ``[batch, q]``
    attention_mask  int64 ``[batch, past + q]``
    past_key_values IPEX fused cache tuple (see :mod:`optimum_ipex_spec.cache`)
    position_ids    int64 ``[batch, q]``
returns ``(logits [batch, q, vocab] in the model dtype, new past_key_values tuple)``.
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Optional

import torch

from ..utils.import_utils import ipex_status

logger = logging.getLogger("optimum_ipex_spec")

#: Architectures whose IPEX fused path we validate token-exact in our test suite.
#: IPEX lists more; anything else runs on the pure-PyTorch path with a warning.
IPEX_FUSED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def ipex_supports(config) -> bool:
    """True when ``config.architectures[0]`` is on IPEX's fused path that we validate."""
    archs = getattr(config, "architectures", None) or []
    return bool(archs) and archs[0] in IPEX_FUSED_ARCHITECTURES


@contextlib.contextmanager
def _quiet_stdout():
    # ipex.llm.optimize prints "ipex.llm.optimize has set the optimized ..." with print().
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def export_to_ipex(model: torch.nn.Module, dtype: torch.dtype) -> torch.jit.ScriptModule:
    """Optimize ``model`` in place with IPEX and return its frozen TorchScript graph.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode, weights in ``dtype``, with
            ``config.architectures`` in :data:`IPEX_FUSED_ARCHITECTURES`.
        dtype: ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        The frozen graph (signature in the module docstring). ``model`` is left modified by IPEX
        and should be discarded.

    Raises:
        ValueError: unsupported dtype or architecture.
        IPEXNotAvailableError: IPEX cannot be imported.
    """
    from ..utils.import_utils import require_ipex

    require_ipex()
    import intel_extension_for_pytorch as ipex

    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"torch_dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if not ipex_supports(model.config):
        raise ValueError(
            f"architecture {model.config.architectures} is not on the IPEX fused path "
            f"(supported: {', '.join(IPEX_FUSED_ARCHITECTURES)})"
        )
    model.eval()
    with _quiet_stdout(), torch.no_grad():
        optimized = ipex.llm.optimize(model, dtype=dtype, inplace=True, deployment_mode=True)
    graph = getattr(optimized, "trace_graph", None)
    if graph is None:
        raise RuntimeError(
            "ipex.llm.optimize did not produce a traced graph for this model "
            f"(IPEX {ipex_status().ipex_version}); use backend='torch'"
        )
    return graph.optimized_model


def load_ipex_graph(path: str) -> torch.jit.ScriptModule:
    """Load a graph saved by :func:`save_ipex_graph` (IPEX must be importable: it registers the ops)."""
    from ..utils.import_utils import require_ipex

    require_ipex()
    import intel_extension_for_pytorch  # noqa: F401  (registers torch.ops.torch_ipex.*)

    graph = torch.jit.load(path, map_location="cpu")
    graph.eval()
    return graph


def save_ipex_graph(graph: torch.jit.ScriptModule, path: str) -> None:
    torch.jit.save(graph, path)


def first_architecture(config) -> Optional[str]:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else None
