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
import warnings
from dataclasses import dataclass
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
def _quiet_export():
    """ipex.llm.optimize prints progress with print() and tracing emits dozens of TracerWarnings and
    deprecation warnings from IPEX's and transformers' internals, none actionable for a user."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "loss_type=None was set in the config but it is unrecognised"
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def export_to_ipex(model: torch.nn.Module, dtype: torch.dtype) -> "IPEXGraphs":
    """Optimize ``model`` in place with IPEX and return its frozen TorchScript graphs.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode, weights in ``dtype``, with
            ``config.architectures`` in :data:`IPEX_FUSED_ARCHITECTURES`.
        dtype: ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        :class:`IPEXGraphs` (signature in the module docstring). ``model`` is left modified by IPEX
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
    with _quiet_export(), torch.no_grad():
        optimized = ipex.llm.optimize(model, dtype=dtype, inplace=True, deployment_mode=True)
    wrapper = getattr(optimized, "trace_graph", None)
    if wrapper is None:
        raise RuntimeError(
            "ipex.llm.optimize did not produce a traced graph for this model "
            f"(IPEX {ipex_status().ipex_version}); use backend='torch'"
        )
    decode_graph = wrapper.optimized_model
    del optimized.trace_graph  # a ScriptModule attribute would stop the second trace
    with _quiet_export():
        verify_graph = trace_verify_graph(optimized, decode_graph, dtype)
    return IPEXGraphs(decode=decode_graph, verify=verify_graph)


@dataclass
class IPEXGraphs:
    """The two frozen graphs of an export (same signature, shared weights).

    decode: IPEX's own trace. Exact for prefill (empty cache) and for one new token on a cache.
    verify: the same model traced with :func:`exact_chunk_attention`; exact for several new tokens
        on a non-empty cache (speculative decoding's verification step), where IPEX's fused
        attention is wrong.
    """

    decode: torch.jit.ScriptModule
    verify: Optional[torch.jit.ScriptModule]


def exact_chunk_attention(
    cls,
    query,
    key,
    value,
    scale_attn,
    layer_past=None,
    head_mask=None,
    attention_mask=None,
    alibi=None,
    add_casual_mask=True,
    seq_info=None,
    text_max_length=0,
    cutoff=None,
    vision=False,
    cache_type=None,
):
    """Drop-in for IPEX's ``_IPEXScaleDotProductCPU.apply_function`` that is exact for a chunk of
    ``q`` new tokens on a cache of ``past`` tokens (batch 1, no padding).

    IPEX's ``masked_multihead_self_attention`` writes the chunk's keys/values into the fused cache
    correctly but returns wrong attention outputs for rows 1..q-1 of the chunk when ``past > 0``
    (measured 0.06-0.47 logit error in fp32, IPEX 2.7 and 2.8). We keep its cache update and
    recompute attention with ``scaled_dot_product_attention`` over cache rows ``0 .. past+q-1``
    and an explicit causal mask (key j visible to chunk row i iff ``j <= past + i``).

    Shapes: query ``[b, q, heads, d]``, key/value ``[b, q, kv_heads, d]`` (post-RoPE); the fused
    buffers are ``[max_pos, b, kv_heads, d]``; returns ``([b, heads, q, d], None, present)`` like IPEX.
    """
    past = layer_past[0].size(-2)
    _, _, key_cache, value_cache, beam_idx = torch.ops.torch_ipex.masked_multihead_self_attention(
        query,
        key,
        value,
        layer_past[1].contiguous(),
        layer_past[2].contiguous(),
        layer_past[3].contiguous(),
        torch.tensor(past, dtype=torch.long),
        scale_attn,
        text_max_length,
        head_mask,
        attention_mask,
        add_casual_mask,
    )
    q = query.size(1)
    total = past + q
    keys = key_cache[:total].permute(1, 2, 0, 3)  # [b, kv_heads, total, d]
    values = value_cache[:total].permute(1, 2, 0, 3)
    groups = query.size(2) // keys.size(1)
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    rows = torch.arange(q).unsqueeze(1) + (total - q)
    visible = torch.arange(total).unsqueeze(0) <= rows
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), keys.to(query.dtype), values.to(query.dtype), attn_mask=visible, scale=1.0 / scale_attn
    )
    present = (torch.empty(1, total, total, 1, dtype=torch.long), key_cache, value_cache, beam_idx)
    return out, None, present


def trace_verify_graph(optimized: torch.nn.Module, decode_graph, dtype: torch.dtype) -> torch.jit.ScriptModule:
    """Trace ``optimized`` (the module ``ipex.llm.optimize`` converted) a second time with
    :func:`exact_chunk_attention`, on a 4-token chunk over an 8-token cache, and freeze it."""
    from ..cache import IPEXFusedCache
    from ..patching import exact_chunk_attention_patch

    num_layers = optimized.config.num_hidden_layers
    with torch.no_grad():
        cache = IPEXFusedCache(num_layers, 1, dtype)
        prompt = torch.ones(1, 8, dtype=torch.long)
        _, layers = decode_graph(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache.ipex_layers,
            position_ids=torch.arange(8).unsqueeze(0),
        )
        example = {
            "input_ids": torch.ones(1, 4, dtype=torch.long),
            "attention_mask": torch.ones(1, 12, dtype=torch.long),
            "past_key_values": layers,
            "position_ids": torch.arange(8, 12).unsqueeze(0),
        }
        saved_return_dict = optimized.config.return_dict
        optimized.config.return_dict = False  # IPEX's output hook would build a ModelOutput
        try:
            with exact_chunk_attention_patch(classmethod(exact_chunk_attention)), torch.autocast(
                "cpu", enabled=dtype == torch.bfloat16, dtype=torch.bfloat16
            ):
                traced = torch.jit.trace(optimized, example_kwarg_inputs=example, strict=False, check_trace=False)
                return torch.jit.freeze(traced)
        finally:
            optimized.config.return_dict = saved_return_dict


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
