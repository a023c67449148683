"""Model FLOPs utilisation: the training FLOPs a step needed per second, over what the devices can do.

A dense transformer's forward and backward cost about 6 FLOPs per parameter per token (2 forward,
4 backward; attention's own FLOPs are left out, as in the PaLM paper's MFU). Peaks are the
vendors' dense (no sparsity) figures per GPU.
"""

from __future__ import annotations

import torch

# (name fragment, TFLOP/s dense in bf16/fp16, TFLOP/s in fp32 (TF32 for NVIDIA's tensor cores))
_PEAKS = (
    ("H200", 989.0, 494.0),
    ("H100", 989.0, 494.0),  # SXM; the PCIe card is lower and matched by "H100 PCIe" below first
    ("A100", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("A10G", 125.0, 62.5),
)
_PCIE = {"H100 PCIe": (756.0, 378.0)}


def flops_per_token(n_params: int) -> float:
    return 6.0 * n_params


def peak_flops(device: torch.device, precision: str, peak_tflops: float = 0.0) -> float:
    """FLOP/s of one device: --peak-tflops if given, else the table; 0 when unknown (CPU)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    low_precision = precision in ("bf16", "fp16")
    for fragment, (half, single) in _PCIE.items():
        if fragment in name:
            return (half if low_precision else single) * 1e12
    for fragment, half, single in _PEAKS:
        if fragment in name:
            return (half if low_precision else single) * 1e12
    return 0.0
