"""Public specifications of common GPUs, for predictions on a GPU that is not here.

Dense tensor-core throughput: datasheets print the figure "with sparsity" too, twice the dense one;
ferry's matmuls are dense. A datasheet's GB of memory is counted here as GiB (2^30 bytes), as the
driver counts it: an H200's "141 GB" is 143,771 MiB in nvidia-smi, an H100's "80 GB" 81,559 MiB.
The link is the bandwidth to another GPU, each way (half the bidirectional figure datasheets give).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ferry.bench.roofline import Hardware


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None: no FP8 tensor cores
    memory_gib: float
    bandwidth_tbps: float
    link_gbps: float  # to another GPU, each way: NVLink where the board has it, else PCIe

    def hardware(self) -> Hardware:
        fp8 = self.fp8_tflops * 1e12 if self.fp8_tflops else None
        return Hardware(self.bf16_tflops * 1e12, self.bandwidth_tbps * 1e12, f"{self.name} (datasheet)", fp8)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


GPUS = (
    # NVIDIA H100 Tensor Core GPU datasheet: SXM5 BF16 1,979 / FP8 3,958 TFLOPS with sparsity, 80 GB,
    # 3.35 TB/s, NVLink 900 GB/s.
    GpuSpec("H100-SXM", 989.5, 1979.0, 80, 3.35, 450),
    # The same datasheet, PCIe: BF16 1,513 / FP8 3,026 with sparsity, 80 GB, 2 TB/s, PCIe Gen5 128 GB/s
    # (without the optional NVLink bridge).
    GpuSpec("H100-PCIe", 756.5, 1513.0, 80, 2.0, 64),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 / FP8 3,958 with sparsity, 141 GB,
    # 4.8 TB/s, NVLink 900 GB/s.
    GpuSpec("H200", 989.5, 1979.0, 141, 4.8, 450),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 dense, no FP8; 80 GB SXM 2,039 GB/s, 40 GB
    # 1,555 GB/s; NVLink 600 GB/s.
    GpuSpec("A100-80GB-SXM", 312.0, None, 80, 2.039, 300),
    GpuSpec("A100-40GB", 312.0, None, 40, 1.555, 300),
    # NVIDIA L40S datasheet: BF16 362.05 / FP8 733 dense, 48 GB GDDR6, 864 GB/s, PCIe Gen4 x16 64 GB/s.
    GpuSpec("L40S", 362.05, 733.0, 48, 0.864, 32),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: BF16 165.2 / FP8 330.3 dense with
    # FP32 accumulation (as torch's matmuls accumulate), 24 GB GDDR6X, 1,008 GB/s, PCIe Gen4 x16.
    GpuSpec("RTX-4090", 165.2, 330.3, 24, 1.008, 32),
    # NVIDIA HGX B200 datasheet, per GPU (the eight-GPU board's figures / 8): BF16 36 / FP8 72 PFLOPS
    # with sparsity, 1,440 GB, 64 TB/s; NVLink 5 1.8 TB/s.
    GpuSpec("B200", 2250.0, 4500.0, 180, 8.0, 900),
)


def _key(name: str) -> str:
    """'H100 SXM', 'h100-sxm' and 'H100_SXM' are one GPU."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_gpu(name: str) -> GpuSpec:
    for spec in GPUS:
        if _key(spec.name) == _key(name):
            return spec
    raise ValueError(f"unknown GPU {name!r}: the table has {', '.join(s.name for s in GPUS)} "
                     "(or give 'measured' for this machine's GPU, 'cpu' for its processor)")


def gpu_named_like(device_name: str) -> GpuSpec | None:
    """The table's GPU that a device's name as the driver gives it ('NVIDIA H200', 'NVIDIA H100 80GB
    HBM3') names: one whose whole name is in it, else the first of its family; None: none."""
    key = _key(device_name)
    whole = [spec for spec in GPUS if _key(spec.name) in key]
    family = [spec for spec in GPUS if _key(spec.name.split("-")[0]) in key]
    return (whole or family or [None])[0]
