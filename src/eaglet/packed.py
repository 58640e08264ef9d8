"""Matrix products of decoding at the speed of the CPU's own kernels: a weight laid out once in
the form the CPU's BLAS reads fastest, then multiplied by a few rows at a time.

Why (measured on a Xeon with AMX, 1 thread, sweeping SmolLM2's 120 layer weights as a target pass
does): in bf16 `F.linear` re-lays each weight out for oneDNN on every call; oneDNN on weights laid
out once reads them at memory speed whatever the rows (1 to 8 rows: 21 ms a sweep, half of
`F.linear`'s). In fp32, MKL's GEMM on 4 rows takes 1.9x its time on 1 row (58 vs 32 ms); MKL on a
weight packed for 4 rows takes 1.3x (41 ms), and is fast for that row count only (3 or 5 rows on a
weight packed for 4 take twice as long), so rows are padded up to the packed count; one or two
rows stay with `F.linear` (MKL's GEMV). These are PyTorch's own kernels
(`torch.ops.mkldnn._linear_pointwise`, `torch.ops.mkl._mkl_linear`, the ones its compiler emits for
frozen CPU weights); where they are missing (another CPU or device, another dtype) `F.linear` does
the work.

bf16 results equal `F.linear`'s bit for bit (the same oneDNN kernel); fp32 results of three rows
and more differ from `F.linear`'s in the last bits (another kernel), and those of one or two rows
equal them, so plain greedy decoding computes exactly what it computed before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# fp32: row counts MKL's packed weights are made for; more rows than the last go through F.linear
FP32_BUCKETS = (4, 8, 16)


def onednn_bf16_ready() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mkl_fp32_ready() -> bool:
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear:
    """y = x @ weight.T (+ bias) for x [M, K], with the weight in the fastest layout for M rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        cpu = weight.device.type == "cpu"
        self.bf16 = cpu and weight.dtype == torch.bfloat16 and onednn_bf16_ready()
        self.fp32 = cpu and weight.dtype == torch.float32 and mkl_fp32_ready()
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1) if self.bf16 else None
        self.mkl: dict[int, torch.Tensor] = {}  # fp32: row bucket -> packed weight, made on first use

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        rows = x.shape[0]
        bucket = next((b for b in FP32_BUCKETS if rows <= b), None) if self.fp32 and rows > 2 else None
        if bucket is None:
            return F.linear(x, self.weight, self.bias)
        if bucket not in self.mkl:
            self.mkl[bucket] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, bucket)
        padded = x if rows == bucket else torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
        y = torch.ops.mkl._mkl_linear(padded, self.mkl[bucket], self.weight, self.bias, bucket)
        return y if rows == bucket else y[:rows]
