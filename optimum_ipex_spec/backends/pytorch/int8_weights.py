"""Weight-only int8 matrices for a cheap draft: int8 weights with one scale per output channel, bf16 activations.

A one-token decode step reads every weight once; int8 weights are half the bytes of bf16 and a quarter of fp32.
PyTorch's own CPU kernel ``torch.ops.aten._weight_int8pack_mm`` (what pytorch-labs/gpt-fast's int8 mode calls)
multiplies bf16 activations by such weights without materialising them in bf16. Measured here (1 thread, one
row, bf16 activations): 2.0x faster than fp32 ``x @ w.T`` on SmolLM2's 576 x 49152 LM head, 2.1x on a
1536 x 8960 matrix. It is slow for many rows (its work grows with the rows: 3.7 ms for 64 rows of a 576 x 3072
matrix, where a bf16 matmul takes 1.0 ms) and with fp32 activations (5x slower than with bf16); so rows above
:data:`KERNEL_MAX_ROWS` (a prefill, a long catch-up) dequantise to bf16 and use a dense matmul, and the module
refuses fp32 activations. The kernel needs an input width that is a multiple of :data:`KERNEL_K_MULTIPLE`.

Quantisation: symmetric, per output channel, ``scale = max|w| / 127``, ``q = round(w / scale)`` in [-127, 127].
"""

from __future__ import annotations

import torch

#: the kernel reads the input dimension in blocks of this many values: other widths give wrong numbers or crash (seen
#: with torch 2.8: 72 and 100 do, 16 ... 896 in steps of 16 do not); such matrices always take the dequantised path
KERNEL_K_MULTIPLE = 16
#: above this many rows the int8 kernel is slower than dequantising and a dense bf16 matmul (measured: faster up to
#: 4 rows, even at 9, 3.7x slower at 64)
KERNEL_MAX_ROWS = 8


def int8_matmul_available() -> bool:
    """True when this torch has the CPU weight-only int8 kernel (``torch.ops.aten._weight_int8pack_mm``)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Weight:
    """A linear layer's weight as int8 with per-output-channel scales.

    Args:
        weight: the dense weight ``[out, in]`` (any float dtype), as in ``nn.Linear.weight``.
        dtype: the activation dtype; only ``torch.bfloat16`` (the kernel's fast path).

    Raises:
        ValueError: ``weight`` is not 2-D, or ``dtype`` is not bf16.
        RuntimeError: this torch lacks the int8 kernel.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        if weight.dim() != 2:
            raise ValueError(f"an int8 weight is a 2-D [out, in] matrix, got shape {tuple(weight.shape)}")
        if dtype != torch.bfloat16:
            raise ValueError(f"int8 weights run with bf16 activations (the CPU kernel is 5x slower with others), "
                             f"got {dtype}: use torch_dtype=torch.bfloat16")
        if not int8_matmul_available():
            raise RuntimeError(f"torch {torch.__version__} has no torch.ops.aten._weight_int8pack_mm; int8 weights "
                               "need torch >= 2.3")
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(dtype)
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantized(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight in the activation dtype (what the int8 values stand for)."""
        return self.qweight.to(self.dtype) * self.scales[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x [..., in]`` bf16; returns ``[..., out]`` bf16."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= KERNEL_MAX_ROWS and self.qweight.shape[1] % KERNEL_K_MULTIPLE == 0:
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales)
        else:
            out = rows @ self.dequantized().t()
        return out.reshape(*x.shape[:-1], self.qweight.shape[0])
