"""Export a transformers causal LM to IPEX: fused kernels + fused KV cache, traced once per path.

``ipex.llm.optimize(model, dtype, deployment_mode=False)`` swaps the attention, MLP, RMSNorm and RoPE modules
for IPEX's fused ones and prepacks the linear weights (oneDNN in fp32, TPP blocks in bf16). We then trace the
optimized module twice with ``torch.jit.trace`` and do not freeze either trace:

* ``decode``: IPEX's own attention; exact for prefill and for one token on a cache;
* ``verify``: the same module traced with :func:`exact_chunk_attention`; exact for a chunk of tokens on a
  non-empty cache (speculative decoding's verification step).

Both traces read the same parameters and prepacked-weight contexts, so the weights are held once (issue 14).
IPEX's own ``deployment_mode=True`` freezes its trace instead, and a frozen graph builds a second prepacked copy
of every linear weight on its first run that it keeps (2x the weights in fp32 and bf16, 4x with the default fp32
kernel; ``benchmarks/ipex_weight_copies.py``), and two frozen graphs cannot share it. The two things freezing
gave at run time are done here by :func:`_simplify_for_inference`.

Graph signature (keyword arguments):
    input_ids       int64 ``[batch, q]``
    attention_mask  int64 ``[batch, past + q]``
    past_key_values IPEX fused cache tuple (see :mod:`optimum_ipex_spec.backends.ipex.cache`)
    position_ids    int64 ``[batch, q]``
returns ``(logits [batch, q, vocab] in the model dtype, new past_key_values tuple)``.

Saved as one TorchScript archive holding both traces (:func:`save_ipex_graphs`); TorchScript's serializer writes a
tensor or prepacked context that both traces share once, and loading restores the sharing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ...facts import IPEX_OPTIMIZED_MARK, LLAMA_FAMILY_ARCHITECTURES, dtype_name
from ...utils.import_utils import require_ipex, require_ipex_dtype
from .cache import IPEXFusedCache
from .patching import exact_chunk_attention_patch, shared_rotary_tables_patch

logger = logging.getLogger("optimum_ipex_spec")

#: Architectures whose IPEX fused path we validate token-exact in our test suite.
#: IPEX lists more; anything else runs on the pure-PyTorch path with a warning.
IPEX_FUSED_ARCHITECTURES = LLAMA_FAMILY_ARCHITECTURES

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
    """Optimize ``model`` in place with IPEX and return its two traced TorchScript graphs (one copy of the weights).

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode, weights in ``dtype``, with
            ``config.architectures`` in :data:`IPEX_FUSED_ARCHITECTURES`.
        dtype: ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        :class:`IPEXGraphs` (signature in the module docstring). ``model`` is left modified by IPEX
        and should be discarded.

    Raises:
        ValueError: unsupported dtype or architecture; bf16 on a CPU without oneDNN bf16 (AVX2 only).
        IPEXNotAvailableError: IPEX cannot be imported.
        RuntimeError: ``ipex.llm.optimize`` left the model unconverted (it falls back silently).
    """
    require_ipex()
    import intel_extension_for_pytorch as ipex

    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"torch_dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    require_ipex_dtype(dtype_name(dtype))
    if not ipex_supports(model.config):
        raise ValueError(
            f"architecture {model.config.architectures} is not on the IPEX fused path "
            f"(supported: {', '.join(IPEX_FUSED_ARCHITECTURES)})"
        )
    model.eval()
    setattr(model, IPEX_OPTIMIZED_MARK, True)  # from here on IPEX may modify the model, also when it fails
    _untie_output_head(model)
    with _quiet_export(), torch.no_grad(), shared_rotary_tables_patch():
        optimized = ipex.llm.optimize(model, dtype=dtype, inplace=True, deployment_mode=False)
    if not _has_ipex_modules(optimized):
        # ipex.llm.optimize logs and returns the model unchanged when it cannot convert it
        raise RuntimeError(
            f"ipex.llm.optimize did not convert this {type(model).__name__} (IPEX {ipex.__version__}); "
            "export it with backend='torch'"
        )
    _drop_unused_linear_weights(optimized)
    _plain_parameters(optimized)
    _copy_out_of_checkpoint_files(optimized)
    with _quiet_export():
        decode_graph, verify_graph = trace_graphs(optimized, dtype)
    for graph in (decode_graph, verify_graph):
        _simplify_for_inference(graph)
    _return_freed_memory()
    return IPEXGraphs(decode=decode_graph, verify=verify_graph)


def ipex_converted(model: torch.nn.Module) -> bool:
    """True when ``ipex.llm.optimize`` rewrote ``model`` in place: IPEX swaps in its own module classes (decoder
    layers, attention, linear); an export also marks the model it handed to IPEX (:data:`IPEX_OPTIMIZED_MARK`,
    set before IPEX runs: a failed export leaves the model modified too)."""
    return bool(getattr(model, IPEX_OPTIMIZED_MARK, False)) or _has_ipex_modules(model)


def _has_ipex_modules(model: torch.nn.Module) -> bool:
    return any(type(module).__module__.startswith("intel_extension_for_pytorch") for module in model.modules())


def _return_freed_memory() -> None:
    """Hand the memory the export freed (the checkpoint's tensors, IPEX's temporaries) back to the system:
    glibc keeps freed heap pages mapped, 0.9 GB for Qwen2.5-0.5B in fp32. A no-op without glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _untie_output_head(model: torch.nn.Module) -> None:
    """Give a tied output head its own weight before IPEX sees it.

    ``ipex.llm.optimize`` leaves a head tied to the input embedding as a plain ``nn.Linear``; in an unfrozen bf16
    trace IPEX's graph pass then prepacks that weight again on every forward (40 ms per token for SmolLM2's
    49152 x 576 head). Untied, the head is prepacked once like every other linear layer. Cost: one more
    ``vocab x hidden`` matrix (the embedding keeps the plain one it gathers rows from). The config keeps
    ``tie_word_embeddings``: it describes the checkpoint, and the export is never tied again.
    """
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)


def _drop_unused_linear_weights(optimized: torch.nn.Module) -> None:
    """Empty the ``weight`` parameter of IPEX's oneDNN linear layers: in inference they compute from their
    prepacked context (``ctx``) and pass an empty tensor for the weight, and the parameter would be written to a
    saved export beside the context's own copy."""
    for module in optimized.modules():
        if getattr(module, "use_dnnl", False) and hasattr(module, "ctx") and not module.training:
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.numel():
                weight.data = torch.empty(0, dtype=weight.dtype)


def _plain_parameters(optimized: torch.nn.Module) -> None:
    """Replace IPEX's ``BlockedParameter`` (a Python subclass holding a TPP-blocked bf16 weight) by a plain
    ``Parameter`` over the same storage. An unfrozen graph reads its parameters at run time, and an op on a Python
    tensor subclass goes through Python dispatch; that call fails with an empty ``RuntimeError`` once another
    model has been exported in the process (IPEX 2.8). The kernels only read the data."""
    for module in optimized.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and type(param) is not torch.nn.Parameter:
                module._parameters[name] = torch.nn.Parameter(param.data, requires_grad=False)


def _file_mappings() -> list:
    """Address ranges of the checkpoint files this process has memory-mapped (Linux; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].endswith((".safetensors", ".bin", ".pt")):
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((low, high))
    except OSError:
        pass
    return ranges


def _copy_out_of_checkpoint_files(optimized: torch.nn.Module) -> None:
    """Copy the tensors that still point into the memory-mapped checkpoint (embedding, norms, biases) into
    memory of their own, so the mapping, and the pages IPEX read from it while prepacking, can be released."""
    ranges = _file_mappings()
    if not ranges:
        return
    for module in optimized.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is None or not tensor.numel():
                    continue
                address = tensor.untyped_storage().data_ptr()
                if any(low <= address < high for low, high in ranges):
                    tensor.data = tensor.data.clone()


def _simplify_for_inference(graph: torch.jit.ScriptModule) -> None:
    """Remove per-call work that freezing would have folded away, in every method of every submodule.

    * ``aten::detach`` of weights (IPEX's TPP linear detaches its blocked weight on every call: 9 ms per token for
      SmolLM2 in bf16): a no-op for inference, which runs without autograd.
    * ``torch_ipex::choose_tpp_linear_weight(x, weight, None)``: a Python-implemented op that returns ``weight``
      when no large-batch weight exists.
    * ``myops::longrope(..., seq_len, rope_type=0)``: a Python-implemented op, called in every layer on every
      forward, that returns its rotary tables unchanged unless ``seq_len`` exceeds them (positions past
      ``max_position_embeddings`` are refused before the graph runs) or the model uses LongRoPE/Falcon tables
      (``rope_type`` 1 and 2: not on our fused path).

    Python-implemented ops also fail in the TorchScript interpreter once another export in the process has run
    (an empty ``RuntimeError``), so removing them is needed for correctness, not only for speed.
    """
    for module in graph.modules():
        for name in module._c._method_names():
            method_graph = module._c._get_method(name).graph
            for node in method_graph.findAllNodes("aten::detach"):
                node.output().replaceAllUsesWith(node.inputsAt(0))
                node.destroy()
            for node in method_graph.findAllNodes("torch_ipex::choose_tpp_linear_weight"):
                if node.inputsAt(2).type().kind() != "NoneType":
                    continue
                node.output().replaceAllUsesWith(node.inputsAt(1))
                node.destroy()
            for node in method_graph.findAllNodes("myops::longrope"):
                if _constant_int(node.inputsAt(10)) != 0:
                    continue
                results = node.outputs()
                for result, source in zip(results, (1, 3, 4, 5)):
                    result.replaceAllUsesWith(node.inputsAt(source))
                node.destroy()


def _constant_int(value) -> Optional[int]:
    """The integer a graph value holds when it is built from a constant (``torch.tensor(0)``, ``.contiguous()``),
    else None."""
    node = value.node()
    while node.kind() in ("aten::contiguous", "aten::tensor", "aten::detach", "aten::to"):
        node = node.inputsAt(0).node()
    if node.kind() != "prim::Constant":
        return None
    constant = node.output().toIValue()
    if isinstance(constant, torch.Tensor) and constant.numel() == 1:
        constant = constant.item()
    return constant if isinstance(constant, int) else None


@dataclass
class IPEXGraphs:
    """The two traced graphs of an export (same signature, one copy of the weights).

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

    IPEX's ``masked_multihead_self_attention`` returns wrong attention outputs for rows 1..q-1 of such a chunk
    (measured 0.06-0.47 logit error in fp32, IPEX 2.7 and 2.8; field notes). We do not call it here: the chunk's
    keys/values are written into the fused buffers at rows ``past .. past+q-1`` (the runner reserves the rows
    first: :meth:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache.reserve`), and attention is one
    ``scaled_dot_product_attention`` over cache rows ``0 .. past+q-1`` with an explicit causal mask (key j
    visible to chunk row i iff ``j <= past + i``). With grouped-query attention the query heads that share a
    key/value head run as rows of one call (no copy of the cache per query head).

    Measured (SmolLM2-135M fp32, 1 thread, 9 tokens on 300 cached): calling IPEX's kernel for its cache write
    and recomputing cost 9 per-row kernel calls per layer plus a per-head copy of the cache.

    Shapes: query ``[b, q, heads, d]``, key/value ``[b, q, kv_heads, d]`` (post-RoPE); the fused
    buffers are ``[capacity, b, kv_heads, d]``; returns ``([b, heads, q, d], None, present)`` like IPEX.
    """
    past = layer_past[0].size(-2)
    key_cache, value_cache, beam_idx = layer_past[1], layer_past[2], layer_past[3]
    q = query.size(1)
    total = past + q
    key_cache.narrow(0, past, q).copy_(key.transpose(0, 1))
    value_cache.narrow(0, past, q).copy_(value.transpose(0, 1))
    batch, heads, head_dim = query.size(0), query.size(2), query.size(3)
    kv_heads = key_cache.size(2)
    groups = heads // kv_heads
    keys = key_cache[:total].permute(1, 2, 0, 3).to(query.dtype)  # [b, kv_heads, total, d]
    values = value_cache[:total].permute(1, 2, 0, 3).to(query.dtype)
    rows = torch.arange(q).unsqueeze(1) + past
    visible = torch.arange(total).unsqueeze(0) <= rows  # [q, total]
    if groups > 1:
        visible = visible.repeat(groups, 1)  # row g*q + i of a key/value head is query head g, chunk row i
    grouped = query.transpose(1, 2).reshape(batch, kv_heads, -1, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible,
                                                           scale=1.0 / scale_attn)
    present = (torch.empty(1, total, total, 1, dtype=torch.long), key_cache, value_cache, beam_idx)
    return out.reshape(batch, heads, -1, head_dim), None, present


def trace_graphs(optimized: torch.nn.Module, dtype: torch.dtype):
    """Trace ``optimized`` (the module ``ipex.llm.optimize`` converted) twice, unfrozen: on an 8-token prompt
    (decode graph) and, with :func:`exact_chunk_attention`, on a 4-token chunk over that prompt's cache (verify
    graph). Returns ``(decode, verify)``; both share ``optimized``'s parameters."""
    num_layers = optimized.config.num_hidden_layers
    prompt = torch.ones(1, 8, dtype=torch.long)

    def prefill_inputs():
        return {
            "input_ids": prompt, "attention_mask": torch.ones_like(prompt),
            "past_key_values": IPEXFusedCache(num_layers, 1, dtype).ipex_layers,
            "position_ids": torch.arange(8).unsqueeze(0),
        }

    saved_return_dict = optimized.config.return_dict
    optimized.config.return_dict = False  # IPEX's output hook would build a ModelOutput
    try:
        with torch.no_grad():
            _, layers = optimized(**prefill_inputs())
            chunk = {
                "input_ids": torch.ones(1, 4, dtype=torch.long),
                "attention_mask": torch.ones(1, 12, dtype=torch.long),
                "past_key_values": layers,
                "position_ids": torch.arange(8, 12).unsqueeze(0),
            }
            decode = torch.jit.trace(optimized, example_kwarg_inputs=prefill_inputs(), strict=False,
                                     check_trace=False)
            with exact_chunk_attention_patch(classmethod(exact_chunk_attention)):
                verify = torch.jit.trace(optimized, example_kwarg_inputs=chunk, strict=False, check_trace=False)
    finally:
        optimized.config.return_dict = saved_return_dict
    return decode.eval(), verify.eval()


class _GraphPair(torch.nn.Module):
    """The container :func:`save_ipex_graphs` writes: the two traces as submodules ``decode`` and ``verify``."""

    def __init__(self, decode, verify):
        super().__init__()
        self.decode = decode
        self.verify = verify


def save_ipex_graphs(graphs: "IPEXGraphs", path: str) -> None:
    """Write both traces into one TorchScript archive; tensors and prepacked contexts they share are written
    once."""
    torch.jit.save(torch.jit.script(_GraphPair(graphs.decode, graphs.verify)), path)


def load_ipex_graphs(path: str) -> "IPEXGraphs":
    """Load an archive written by :func:`save_ipex_graphs`, or a single decode graph (export format 1).

    Raises:
        RuntimeError: not a TorchScript archive (from ``torch.jit.load``).
    """
    graph = load_ipex_graph(path)
    _return_freed_memory()  # the archive's bytes, read whole before IPEX repacked the weights from them
    if graph._c.hasattr("decode") and graph._c.hasattr("verify"):
        return IPEXGraphs(decode=graph.decode, verify=graph.verify)
    return IPEXGraphs(decode=graph, verify=None)


def load_ipex_graph(path: str) -> torch.jit.ScriptModule:
    """Load a graph saved by :func:`save_ipex_graph` (IPEX must be importable: it registers the ops)."""
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
