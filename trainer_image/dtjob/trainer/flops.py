"""Model FLOPs utilisation: the training FLOPs a step needed per second, over what the devices can do.

FLOPs per token of a decoder-only transformer's forward and backward (PaLM, Chowdhery et al. 2022,
appendix B; the same count as Megatron-LM's, Narayanan et al. 2021, without recomputation):

    6 * N  +  12 * layers * seq_len * width

6 per parameter (2 forward, 4 backward: every weight is one multiply-add per token, twice more for
the gradients of inputs and weights), plus attention's two sequence-long matmuls (Q K^T and
scores x V: 2 * 2 * seq_len * width per token and layer forward, 3x that with the backward). The
attention term counts the whole seq_len x seq_len square, as PaLM and Megatron do, although a
causal mask makes half of it unneeded; recomputed activations are not counted (MFU, not HFU).

Peaks are the vendors' dense (no sparsity) figures per GPU, for the precision the matmuls really
run in: bf16/fp16 on the tensor cores; fp32 either as TF32 on the tensor cores (only when torch
allows it: `torch.backends.cuda.matmul.fp32_precision = "tf32"`, `allow_tf32 = True` or
`torch.set_float32_matmul_precision("high"/"medium")`) or as plain FP32 on the CUDA cores, which
is torch's default and 7-15x slower: measured against the TF32 peak, an fp32 run's MFU would
look 7x worse than it is.
"""

from __future__ import annotations

import torch

# name fragment -> TFLOP/s dense: (bf16/fp16 tensor cores, TF32 tensor cores, plain FP32)
_PEAKS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    # PCIe cards first: their names contain the SXM fragment too ("H100 PCIe" holds "H100").
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H200", (989.0, 494.0, 67.0)),  # SXM
    ("H100", (989.0, 494.0, 67.0)),  # SXM
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("A10G", (125.0, 62.5, 31.2)),  # the A10's datasheet figures
)


def flops_per_token(n_params: int, layers: int = 0, seq_len: int = 0, width: int = 0) -> float:
    """Training (forward + backward) FLOPs per token; see the module docstring. Without
    layers/seq_len/width (a model that is not a transformer) only the 6 * N term."""
    return 6.0 * n_params + 12.0 * layers * seq_len * width


def peak_tflops_of(device_name: str, precision: str, tf32: bool) -> float:
    """Dense TFLOP/s of the GPU named `device_name` for `precision` ("bf16", "fp16", "fp32"), fp32
    with TF32 matmuls or without; 0 when the GPU is not in the table."""
    for fragment, (half, tensor_fp32, plain_fp32) in _PEAKS:
        if fragment in device_name:
            if precision in ("bf16", "fp16"):
                return half
            return tensor_fp32 if tf32 else plain_fp32
    return 0.0


def tf32_matmuls() -> bool:
    """Whether torch runs fp32 CUDA matmuls as TF32 now. torch >= 2.9 has `fp32_precision`
    ("tf32", "ieee", or "none": the legacy flags decide); reading the legacy flags after the new
    API set "tf32" raises, so the new one is read first."""
    matmul = torch.backends.cuda.matmul
    new = getattr(matmul, "fp32_precision", "none")
    if new in ("tf32", "ieee"):
        return bool(new == "tf32")
    try:
        return bool(matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the two APIs were mixed; torch itself refuses to say
        return False


def peak_flops(
    device: torch.device, precision: str, peak_tflops: float = 0.0, tf32: bool | None = None
) -> float:
    """FLOP/s of one device: --peak-tflops if given, else the table (fp32: TF32's peak only when
    TF32 is on, `tf32` or else torch's flags now); 0 when unknown (CPU)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return 0.0
    allowed = tf32_matmuls() if tf32 is None else tf32
    return peak_tflops_of(torch.cuda.get_device_name(device), precision, allowed) * 1e12
