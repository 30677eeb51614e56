"""Dense peak TFLOP/s per device (per GPU; per GCD for AMD MI250X), by precision.

Matched by substring of the device name (torch.cuda.get_device_name). fp32 means the
plain FP32 pipeline (no TF32 on NVIDIA, which torch leaves off for matmuls by default).
Sources: vendor data sheets —
  A100 SXM: nvidia.com A100 datasheet (bf16 312, fp32 19.5);
  H100 SXM: nvidia.com H100 datasheet (bf16 989.4 dense, fp32 66.9); H100 PCIe (756, 51.2);
  H200 SXM: nvidia.com H200 datasheet (same GPU as H100 SXM: 989.4, 66.9);
  GH200: nvidia.com GH200 datasheet (989, 67);
  MI250X: amd.com MI250X datasheet, 383 bf16 / 95.7 fp32-matrix per package = 2 GCDs;
  MI300X: amd.com MI300X datasheet (bf16 1307.4, fp32 163.4 matrix).
H100 NVL and H200 NVL (PCIe cards of the same die at a lower power and clock) have no entry
on purpose: no vendor datasheet at hand gives their dense peak, and the SXM figure that the
"H100"/"H200" substrings would match reads MFU about 15% low. A deck on them sets `run.peak_tflops`.
An unknown device (any CPU) has no entry: MFU is reported as null unless the deck gives
`run.peak_tflops` — never a guess.
"""

from __future__ import annotations

from typing import Optional

# (substring, precision) -> TFLOP/s; the most specific substrings come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 NVL", {}),  # unknown peak (module docstring): not the SXM entry below
    ("H200 NVL", {}),
    ("GH200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("MI250X", {"bf16": 191.5, "fp16": 191.5, "fp32": 47.85}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
)


def peak_tflops(device_name: str, precision: str = "fp32", override: Optional[float] = None) -> Optional[float]:
    """Peak TFLOP/s of one device for `precision`; `override` (the deck's) wins; None if unknown."""
    if override is not None:
        return override
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(precision)
    return None
