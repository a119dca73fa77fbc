"""Dense weights reordered once for oneDNN's matmul: the fast CPU path for bf16 at any row count, and for fp32
chunks of several rows (prefill, speculative decoding's verification).

``torch.ops.mkldnn._reorder_linear_weight`` lays a ``[out, in]`` weight out in oneDNN's blocked format (what
Inductor's freezing pass does for ``nn.Linear``); ``torch.ops.mkldnn._linear_pointwise`` then multiplies by it.
Measured here (SmolLM2-135M's 211 decoder and head matrices, 1 thread, sum over one forward, ms):

======  ==========================  =====  =====  =====  =====
dtype   layout                      1 row  2      5      9
======  ==========================  =====  =====  =====  =====
fp32    ``x @ W.T`` (transposed)    36     55     73     92
fp32    ``F.linear`` (model's)      40     44     80     109
fp32    oneDNN reordered            47     48     51     58
bf16    ``x @ W.T`` (transposed)    44     37     38     38
bf16    ``F.linear`` (model's)      35     39     39     39
bf16    oneDNN reordered (AMX)      26     26     26     26
======  ==========================  =====  =====  =====  =====

So bf16 uses the reordered weight for everything; fp32 keeps the transposed copy for one-row products (a decode
step) and long prefills, and uses the reordered one for the chunks between: a verification of 9 tokens then costs
1.6 one-token steps instead of 2.3.
A row's result does not depend on how many rows the call has for bf16 and for fp32 matrices with an input
width of 576 (SmolLM2's); fp32 down projections (1536 wide) round one-row products differently (2.5e-6).
"""

from __future__ import annotations

import functools
import logging
import torch

logger = logging.getLogger("optimum_ipex_spec")

#: oneDNN picks its blocking for this many rows; measured flat from 2 to 17 rows with it (fp32 and bf16)
ROWS_HINT = 9
#: fp32 products of more rows than this (a prefill) go back to the transposed copy: MKL is as fast or faster there
#: (measured, SmolLM2's matrices: 64 rows 126 vs 139 ms, 300 rows 492 vs 527; 33 rows 123 vs 94)
FP32_REORDERED_MAX_ROWS = 48


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """True when this torch can reorder and multiply weights with oneDNN (x86 builds with mkldnn; checked once by
    reordering a small matrix, since the ops exist on builds where they fail)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        weight = torch.ones(8, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16), packed, None, "none", [], "")
        return bool(torch.all(out == 16.0))
    except RuntimeError as error:  # a build without oneDNN's CPU matmul
        logger.warning("oneDNN weight reordering is unavailable (%s): the pure-PyTorch decoder multiplies "
                       "transposed weights instead (slower for bf16 and for chunks)", error)
        return False


class OneDNNWeight:
    """A linear layer's weight reordered for oneDNN: ``x @ W.T`` (the caller adds a bias).

    Args:
        weight: the dense weight ``[out, in]`` (fp32 or bf16), as in ``nn.Linear.weight``; reordered into a new
            tensor (the argument is not kept).

    Raises:
        ValueError: ``weight`` is not 2-D or not fp32/bf16.
    """

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a oneDNN weight is a 2-D fp32 or bf16 [out, in] matrix, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (this weight's dtype) -> ``[..., out]``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class FewRowsSplit:
    """One fp32 projection in two layouts: ``x @ transposed`` for a single row and for more than
    :data:`FP32_REORDERED_MAX_ROWS` (a prefill), ``many(x)`` for the chunks in between (a verification).

    Args:
        transposed: the transposed weight ``[in, out]`` (contiguous: MKL's fastest one-row product here).
        many: the same weight as a :class:`OneDNNWeight`.
    """

    def __init__(self, transposed: torch.Tensor, many: OneDNNWeight):
        self.transposed = transposed
        self.many = many

    @property
    def shape(self) -> torch.Size:
        return self.many.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` fp32 -> ``[..., out]`` (no bias: the caller adds it)."""
        rows = x.numel() // x.shape[-1]
        if rows == 1 or rows > FP32_REORDERED_MAX_ROWS:
            return x @ self.transposed
        return self.many(x)
