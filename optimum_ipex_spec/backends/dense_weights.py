"""The model's own dense weights, multiplied with the kernel that is fastest on this CPU for the row count: the
pure-PyTorch decoder holds no copy of a weight.

A weight stays the ``nn.Linear`` layer's ``[out, in]`` row-major tensor; what changes with the row count of
``x [..., in]`` is the kernel:

* fp32, 1 row (a decode step): ``torch.mv`` / ``torch.addmv`` (MKL's matrix-vector product);
* fp32, an output head (at least :data:`WIDE_MIN_OUT` output rows: a vocabulary), 2 to
  :data:`WIDE_TRANSPOSED_MAX_ROWS` rows: the transposed product too;
* fp32, :data:`FP32_ONEDNN_MIN_ROWS` to :data:`CHUNK_MAX_ROWS` rows: oneDNN's matmul on the plain weight
  (``torch.ops.mkldnn._linear_pointwise`` takes an un-reordered weight);
* otherwise (bf16 at any row count, fp32 2-3 rows, long prefills, other dtypes): ``F.linear``, as stock
  transformers.

Measured here, 1 thread, the sum over a model's decoder matrices (no LM head) with each multiplied once, ms
(micro-benchmarks of the same products; weights not in cache):

================================  =====  =====  =====  =====  ====================================
Qwen2.5-Coder-1.5B shapes         1 row  2      5      9
================================  =====  =====  =====  =====  ====================================
fp32 ``mv``                       337
fp32 ``F.linear``                 337    362    730    1030
fp32 oneDNN, plain weight         367    440    485    569
fp32 transposed copy ``x @ W.T``  313    523    680    900    a 2nd copy (this module's predecessor)
fp32 oneDNN-reordered copy        375    400    382    475    a 2nd copy (its chunks)
bf16 ``mv``                       194
bf16 ``F.linear``                 280    260    265    266
bf16 ``(W @ x.T).T``                     200    199    200
bf16 oneDNN-reordered copy        202    200    198    201    a 2nd copy (its predecessor's layout)
================================  =====  =====  =====  =====  ====================================

Remeasured on 2026-12-05 (same machine, torch 2.13 and 2.8 alike, each model's q/o/gate/up/down shapes, bf16, one
row): ``mv`` read 5.8 (SmolLM2), 6.8 (Qwen2.5 0.5B) and 9.6 GB/s (1.5B), ``F.linear`` and ``W @ x`` 8.5, 9.8 and 11.3
GB/s; a one-token bf16 step of SmolLM2 took 58.9 ms on ``addmv`` and 42.8 on ``F.linear``. Chunks too: SmolLM2's
fused decoder matrices, ``(W @ x.T).T`` against ``F.linear``, 38.3 / 25.2 ms for 2 rows, 39.3 / 35.5 for 9, 68 / 59 for
34, even from 64 to 128, 235 / 184 for 166 (Qwen2.5 0.5B's alike); a bf16 head of 2-9 rows (49152 x 576, 151936 x
896) 10-54 ms transposed against 6.5-41 ``F.linear``. So bf16 now runs ``F.linear`` at every row count: the table's
bf16 rows no longer hold. fp32 ``mv`` and ``F.linear`` stayed even (12 GB/s).

SmolLM2-135M's shapes ranked the same then (bf16: 23 ms ``mv``, 24 ``(W @ x.T).T`` for 2-9 rows, 34 ``F.linear``;
fp32 2-3 rows ``F.linear`` 35-38 against oneDNN 49-50). So with one copy a bf16 step or chunk is as fast as with
the reordered copy, and in fp32 a decode step costs 7% more and a chunk 15-25% more than with two copies (on the
whole SmolLM2 fp32 forward over a 300-token cache: 53 vs 50 ms for one token, 90 vs 69 for 5, 97 vs 78 for 9).
Fusing q/k/v (and gate/up) into one matrix saves 7% of a bf16 SmolLM2 decode step (21.2 vs 22.8 ms) and
nothing measurable in fp32 (within 3% either way).

An output head is another case: MKL's ``F.linear`` of 2-4 rows on a vocabulary-sized fp32 weight costs 2-3.5x its
one-row product (it appears to repack the whole weight per call), where the transposed product costs about one
(AMD EPYC Zen 4, 1 thread, torch 2.8 and 2.13 alike; ms for 1 / 2 / 3 / 4 / 5 rows, ``F.linear`` -> transposed ->
oneDNN):

========================  ====  =================  =================  =================  =================
head ``[out, in]``        1     2                  3                  4                  5
========================  ====  =================  =================  =================  =================
SmolLM2 49152 x 576       11    25 / 6.5 / 10      37 / 8.4 / 11      18 / 10 / 11       19 / 11 / 11
Qwen2.5 151936 x 896      39    94 / 29 / 45       146 / 42 / 47      89 / 45 / 50       99 / 63 / 54
Gemma 3 262144 x 640      56    130 / 35 / -       196 / 49 / -       -                  121 / 61 / -
========================  ====  =================  =================  =================  =================

A verification of 1-3 draft tokens is where that matters: Gemma 3 270M verified 2 tokens in 2.3 decode steps.
:class:`DenseLinear` gives an ``nn.Linear`` (the head of a model on transformers' own forward) these kernels.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("optimum_ipex_spec")

#: products of more rows than this (a long prefill) go to ``F.linear``, stock's kernel, as fast from here on
#: (measured, 0.5B shapes, 300 rows: fp32 1350 ms oneDNN vs 1300 ``F.linear``; bf16 240 ``(W @ x.T).T`` vs 228)
CHUNK_MAX_ROWS = 128
#: fp32 products of fewer rows than this go to ``F.linear`` (1.5B shapes, 3 rows: 379 ms vs 455 oneDNN)
FP32_ONEDNN_MIN_ROWS = 4
#: an fp32 weight with at least this many output rows is an output head (a vocabulary): the transposed product for
#: 2 to WIDE_TRANSPOSED_MAX_ROWS rows (table in the module docstring)
WIDE_MIN_OUT = 32768
WIDE_TRANSPOSED_MAX_ROWS = 4


@functools.lru_cache(maxsize=None)
def onednn_bf16_available() -> bool:
    """True when this CPU has native bf16 for oneDNN (AVX512-BF16/AMX or AVX512-BW/VL/DQ); on an AVX2-only CPU bf16
    arithmetic is emulated (slower than fp32) and Inductor's compiled bf16 step was wrong (compiled_step.py)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """True when this torch can multiply by a plain fp32 weight with oneDNN's matmul (x86 builds with mkldnn;
    checked once with a small product, since the op exists on builds where it fails)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(3, 16), torch.ones(8, 16), None, "none", [], "")
        return bool(torch.all(out == 16.0))
    except RuntimeError as error:  # a build without oneDNN's CPU matmul
        logger.warning("oneDNN's matmul is unavailable (%s): the pure-PyTorch decoder multiplies fp32 chunks with "
                       "F.linear instead (a verification of 9 tokens about 1.4x slower)", error)
        return False


class DenseProjection:
    """``x @ W.T + b`` on a dense weight held as it is (no copy), with the kernel the module docstring picks for
    the row count.

    Args:
        weight: ``[out, in]`` fp32 or bf16 (other dtypes run ``F.linear`` for every row count), e.g. an
            ``nn.Linear`` layer's weight, whose memory this shares: it must not be modified in place afterwards.
        bias: ``[out]`` or None.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        self.weight = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = self.weight.shape
        self._vector = self.weight.dtype == torch.float32  # bf16: F.linear at every row count (above)
        self._wide = self.weight.dtype == torch.float32 and self.out_features >= WIDE_MIN_OUT
        self._onednn = self.weight.dtype == torch.float32 and self.weight.is_contiguous() and onednn_available()

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> "DenseProjection":
        """The projection of an ``nn.Linear`` layer, on its own weight and bias."""
        return cls(linear.weight, linear.bias)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (the weight's dtype) -> ``[..., out]``."""
        rows = x.numel() // self.in_features
        if rows == 1 and self._vector:
            flat = x.reshape(self.in_features)
            out = torch.mv(self.weight, flat) if self.bias is None else torch.addmv(self.bias, self.weight, flat)
            return out.view(*x.shape[:-1], self.out_features)
        if rows <= CHUNK_MAX_ROWS:
            if 1 < rows <= WIDE_TRANSPOSED_MAX_ROWS and self._wide:
                columns = x.reshape(rows, self.in_features).t()
                out = (torch.mm(self.weight, columns) if self.bias is None
                       else torch.addmm(self.bias.unsqueeze(1), self.weight, columns))
                # contiguous: the transposed view made the attention and MLP elementwise work after it slower
                return out.t().contiguous().view(*x.shape[:-1], self.out_features)
            if self._onednn and rows >= FP32_ONEDNN_MIN_ROWS:
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class DenseLinear(torch.nn.Linear):
    """An ``nn.Linear`` that multiplies with :class:`DenseProjection`'s kernels: the same parameters, state dict and
    tying. :func:`use_dense_kernels` turns a model's output head into one in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DenseProjection(self.weight, self.bias)(x)


def use_dense_kernels(model: torch.nn.Module) -> None:
    """Make ``model``'s output head (``get_output_embeddings()``, when a plain ``nn.Linear``) a :class:`DenseLinear`,
    in place: its verification chunks then run the kernels above instead of ``F.linear`` (Gemma 3 270M: a 3-token
    verification's head 49 instead of 196 ms). Output logits are the same products, summed in another order."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear:
        head.__class__ = DenseLinear
