"""Model FLOPs utilisation: the FLOPs a model needs per token, over what the devices could do at their peak.

    MFU = tokens/s x FLOPs per token / (devices x peak FLOP/s)

as nanoGPT's estimate_mfu and PaLM (appendix B) define it: FLOPs per token counts the model's arithmetic (6N for
the forward and backward matmuls plus attention's 12 L H Q T; jaxpar.models.gpt.flops_per_token), not what the
program happens to execute (recomputation, padding), so a run that wastes work scores lower. The peak is the dense
bf16/fp16 tensor-core rate from the vendors' data sheets (no sparsity), looked up from the device's name, or
--peak-tflops. CPUs have no entry: give --peak-tflops (bench/gpt.py measures a GEMM peak instead).
"""
from __future__ import annotations

import re

import jax

PEAK_TFLOPS = {  # device-name pattern -> dense bf16 TFLOP/s; the first match wins (more specific names first)
    r"H100 PCIe": 756.0,
    r"H100 NVL": 835.0,
    r"GH200|H200|H100": 989.0,  # SXM
    r"B200": 2250.0,
    r"A100": 312.0,
    r"L40S": 362.0,
    r"L40\b": 181.0,
    r"\bL4\b": 121.0,
    r"\bA10\b": 125.0,
    r"RTX 4090": 165.0,  # with float32 accumulation
    r"V100": 125.0,  # fp16 (no bf16 units)
    r"\bT4\b": 65.0,  # fp16
    r"MI300X": 1307.0,
    r"MI250X": 383.0,
}


def peak_tflops(device: jax.Device | None = None) -> float | None:
    """The device's dense bf16 peak in TFLOP/s from PEAK_TFLOPS (by its device_kind), None when unknown (CPUs)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    kind = getattr(device, "device_kind", "")
    for pattern, peak in PEAK_TFLOPS.items():
        if re.search(pattern, kind):
            return peak
    return None


def utilisation(tokens_per_s: float, flops_per_token: float, devices: int = 1,
                peak: float | None = None) -> dict[str, float]:
    """{"tokens_per_s", "model_tflops" (achieved, all devices), and "peak_tflops", "mfu" when a peak is known}.
    `peak` is per device, in TFLOP/s (default: the table's, for jax.devices()[0])."""
    peak = peak_tflops() if peak is None else peak
    out = {"tokens_per_s": tokens_per_s, "model_tflops": tokens_per_s * flops_per_token / 1e12}
    if peak:
        out.update(peak_tflops=peak, mfu=out["model_tflops"] / (peak * devices))
    return out
