"""Weight-only int4 from any dense checkpoint (``weights="int4"``): each projection, the LM head and the input
embedding quantized at load into ggml's 4-bit blocks, and multiplied by the GGUF kernels
(:class:`~optimum_ipex_spec.backends.pytorch.gguf_weights.GGUFLinear`), exact or fast mode, fp32 activations.

A decode step reads every weight once, so the block type decides the speed:

* a row of a multiple of 256 values becomes Q4_K super-blocks (4.5 bits per weight: 8 groups of 32 values, each a
  6-bit scale and a 6-bit minimum under the super-block's fp16 ``d`` and ``dmin``), the type our fast kernel streams
  closest to the memory's speed;
* other rows (Qwen2.5-0.5B's 896, SmolLM2's 576 values) become Q4_1 blocks (5 bits: 32 values, an fp16 step and
  minimum), made by gguf-py's own quantizer (``gguf.quants.quantize``), as llama.cpp's files fall back to 32-value
  blocks there.

gguf-py has no Q4_K quantizer; :func:`quantize_q4_k` is ours: per group, the minimum ``lo = min(0, min w)`` and the
step ``(max w - lo) / 15``; per super-block ``d = max step / 63`` and ``dmin = max(-lo) / 63`` in fp16; the 6-bit scale
and minimum rounded from them; codes ``(w + dmin * m) / (d * s)`` rounded into 0..15. llama.cpp's own quantizer
(``make_qkx2_quants``) searches each group's scale and minimum; this one does not (docs/gguf.md measures it against
Q4_1 everywhere). The dense weights are released as each matrix is replaced, so
the model is held once. Speculative decoding over an int4 target is exact against that int4 target alone, for the
reason a GGUF target's is: every row count gives each row the same bits.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...facts import resolve_dtype
from ...kernels.gguf import BLOCK_TYPES, MODES, BlockType, row_bytes
from .gguf_weights import LAYER_PROJECTIONS, GGUFEmbedding, GGUFLinear

#: the block types ``weights="int4"`` holds: Q4_K where a row is a multiple of 256 values, else Q4_1
Q4_K, Q4_1 = BLOCK_TYPES[12], BLOCK_TYPES[3]
#: weight rows quantized at a time (bounds the temporary fp32 arrays: a few MB per call)
QUANTIZE_ROWS = 1024
#: the largest finite fp16 value (blocks hold their scales and minimums in fp16)
FP16_MAX = 65504.0


def int4_block(k: int) -> BlockType:
    """The block type of an int4 row of ``k`` values: Q4_K for a multiple of 256, else Q4_1.

    Raises:
        ValueError: ``k`` is not a multiple of 32."""
    if k % Q4_K.values == 0:
        return Q4_K
    if k % Q4_1.values == 0:
        return Q4_1
    raise ValueError(f"int4 weights group {Q4_1.values} values per scale; this matrix's rows hold {k} values, not a "
                     f"multiple of {Q4_1.values}. Use weights='dense' for this model")


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, k]`` (``k`` a multiple of 256, finite) -> Q4_K super-blocks, uint8 ``[rows, k / 256 * 144]``
    (ggml's ``block_q4_K``: ``d``, ``dmin`` fp16; 12 bytes of packed 6-bit scales and minimums; 128 bytes of codes,
    groups ``2i`` and ``2i + 1`` sharing bytes ``32i..32i+31``, low and high nibbles)."""
    rows, k = weight.shape
    w = weight.reshape(-1, 8, 32)
    n = w.shape[0]
    lo = w.amin(-1).clamp(max=0)
    step = (w.amax(-1) - lo) / 15
    d = (step.amax(-1) / 63).to(torch.float16)
    dmin = ((-lo).amax(-1) / 63).to(torch.float16)
    if not (bool(torch.isfinite(d).all()) and bool(torch.isfinite(dmin).all())):
        raise ValueError(f"a weight matrix [{rows}, {k}] holds values beyond fp16's range (|w| above "
                         f"{FP16_MAX * 63:g}): int4 blocks cannot scale them. Use weights='dense' for this model")
    df, dminf = d.float()[:, None], dmin.float()[:, None]
    zeros = torch.zeros_like(step)
    scale = torch.where(df > 0, torch.round(step / df), zeros).clamp(0, 63)
    minimum = torch.where(dminf > 0, torch.round(-lo / dminf), zeros).clamp(0, 63)
    q_step, q_offset = (df * scale)[..., None], (dminf * minimum)[..., None]
    codes = torch.where(q_step > 0, torch.round((w + q_offset) / q_step), torch.zeros_like(w)).clamp(0, 15)
    codes, scale, minimum = codes.to(torch.uint8), scale.to(torch.uint8), minimum.to(torch.uint8)
    out = torch.empty(n, Q4_K.bytes, dtype=torch.uint8)
    out[:, 0:2] = d.view(torch.uint8).reshape(n, 2)
    out[:, 2:4] = dmin.view(torch.uint8).reshape(n, 2)
    # groups 0-3: 6 bits in bytes 0-3 (scale) and 4-7 (minimum); groups 4-7: low 4 bits in bytes 8-11, high 2 bits
    # in the top bits of bytes 0-3 (scale) and 4-7 (minimum)
    out[:, 4:8] = scale[:, 0:4] | ((scale[:, 4:8] >> 4) << 6)
    out[:, 8:12] = minimum[:, 0:4] | ((minimum[:, 4:8] >> 4) << 6)
    out[:, 12:16] = (scale[:, 4:8] & 15) | ((minimum[:, 4:8] & 15) << 4)
    codes = codes.reshape(n, 4, 2, 32)
    out[:, 16:] = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, 128)
    return out.reshape(rows, -1)


def quantize_int4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (any float dtype) as int4 blocks of :func:`int4_block` ``(in)``'s type: uint8
    ``[out, row_bytes(block, in)]``.

    Raises:
        ValueError: ``weight`` is not 2-D, its rows are not a multiple of 32 values, or it holds a NaN, an infinity
            (a damaged checkpoint: quantizing would hide it) or values beyond fp16's range.
    """
    if weight.dim() != 2:
        raise ValueError(f"int4 weights quantize a 2-D [out, in] matrix, got shape {tuple(weight.shape)}")
    rows, k = weight.shape
    block = int4_block(k)
    from gguf import GGMLQuantizationType, quants

    out = torch.empty(rows, row_bytes(block, k), dtype=torch.uint8)
    for start in range(0, rows, QUANTIZE_ROWS):
        chunk = weight[start:start + QUANTIZE_ROWS].detach().to(torch.float32)
        if not bool(torch.isfinite(chunk).all()):
            raise ValueError(f"a weight matrix [{rows}, {k}] holds NaN or infinite values (rows from {start}): the "
                             "checkpoint is damaged; int4 quantization would hide it")
        if block is Q4_1 and float(chunk.abs().amax()) > FP16_MAX / 2:  # fp16 minimum and step (max - min) / 15
            raise ValueError(f"a weight matrix [{rows}, {k}] holds values beyond fp16's range (|w| above "
                             f"{FP16_MAX / 2:g}): int4 blocks cannot scale them. Use weights='dense' for this model")
        if block is Q4_K:
            blocks = quantize_q4_k(chunk)
        else:
            blocks = torch.from_numpy(np.ascontiguousarray(
                quants.quantize(chunk.numpy(), GGMLQuantizationType(block.qtype))))
        out[start:start + chunk.shape[0]] = blocks
    return out


def _int4_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], mode: str) -> GGUFLinear:
    blocks = quantize_int4(weight)
    bias = None if bias is None else bias.detach().to(torch.float32).clone()
    return GGUFLinear(blocks, int4_block(weight.shape[1]), weight.shape[1], bias, mode=mode)


def quantize_model_int4(model: torch.nn.Module, mode: str = "exact") -> torch.nn.Module:
    """Replace, in place, each decoder layer's projections, the LM head and the input embedding of ``model`` (a
    transformers causal LM of the Llama family, fp32) by int4 :class:`GGUFLinear` / :class:`GGUFEmbedding` modules;
    a tied head multiplies the embedding's blocks (held once). Returns ``model``.

    Args:
        mode: the kernels' mode, "exact" or "fast" (:data:`~optimum_ipex_spec.kernels.gguf.MODES`).

    Raises:
        ValueError: ``model`` is not fp32; a matrix :func:`quantize_int4` refuses.
    """
    if model.dtype != torch.float32:
        raise ValueError(f"weights='int4' multiplies fp32 activations by the int4 blocks; this model is {model.dtype}: "
                         "load it with torch_dtype=torch.float32")
    for layer in model.model.layers:
        for path in LAYER_PROJECTIONS.values():
            parent, attr = path.split(".")
            linear = getattr(getattr(layer, parent), attr)
            setattr(getattr(layer, parent), attr, _int4_linear(linear.weight, linear.bias, mode))
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    table = _int4_linear(inner.embed_tokens.weight, None, mode if tied else "exact")  # untied: only looked up
    inner.embed_tokens = GGUFEmbedding(table)
    model.lm_head = table if tied else _int4_linear(model.lm_head.weight, model.lm_head.bias, mode)
    return model


def check_load_options(weights: str, torch_dtype, backend: str, gguf_mode: Optional[str]) -> None:
    """Refuse, before a checkpoint is read, what ``from_pretrained(..., weights=...)`` of a dense checkpoint cannot
    honour: ``weights`` outside "dense", "int8" (weight-only int8, bf16 activations) and "int4" (this module, fp32
    activations); the IPEX backend with quantized weights; the dtype the format does not run; ``gguf_mode`` (the
    block kernels' mode) with weights other than "int4".

    Raises:
        ValueError: as above, naming the fix.
    """
    if weights not in ("dense", "int8", "int4"):
        raise ValueError(f"from_pretrained takes weights='dense' (default), 'int8', 'int4' (quantized at load) or "
                         f"'gguf' (a GGUF file's blocks as shipped), got {weights!r}")
    if gguf_mode is not None and weights != "int4":
        raise ValueError(f"gguf_mode= is the mode of the block kernels, for weights='int4' or 'gguf'; "
                         f"got it with weights={weights!r}")
    if gguf_mode is not None and gguf_mode not in MODES:
        raise ValueError(f"gguf_mode must be one of {MODES}, got {gguf_mode!r}")
    if weights == "dense":
        return
    if backend == "ipex":
        raise ValueError(f"weights={weights!r} runs on our pure-PyTorch decoder: pass backend='auto' or 'torch', or "
                         "weights='dense' for IPEX")
    dtype = None if torch_dtype in (None, "auto") else resolve_dtype(torch_dtype)
    if dtype is not None and dtype != activation_dtype(weights):
        raise ValueError(f"weights={weights!r} runs with {'bf16' if weights == 'int8' else 'fp32'} activations; got "
                         f"{torch_dtype}. Pass torch_dtype=torch.{'bfloat16' if weights == 'int8' else 'float32'} "
                         "(or leave it out), or give from_transformers_model a model in that dtype")


def activation_dtype(weights: str) -> torch.dtype:
    """The activations' dtype of a weight format quantized at load: bf16 for "int8" (PyTorch's int8 kernel), fp32
    for "int4" (the block kernels)."""
    return torch.bfloat16 if weights == "int8" else torch.float32
