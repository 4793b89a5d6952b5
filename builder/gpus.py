"""The GPU table (builder/data/gpus.json): memory, bandwidth, peak FLOP/s per precision and
interconnect of each GPU, with the datasheet each figure comes from."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from .errors import UserError

GB = 1e9
# Weight-only int8/int4 run their GEMMs in 16-bit after dequantization; w8a8 in int8; fp32 as TF32.
TFLOPS_KEY = {"fp32": "tf32", "fp16": "float16", "bf16": "bfloat16", "fp8": "fp8", "int8": "float16",
              "w8a8": "int8", "int4": "float16", "fp4": "fp4"}


@dataclass(frozen=True)
class Gpu:
    name: str
    sm: str
    memory_bytes: float
    bandwidth: float            # bytes/s
    tflops: dict
    interconnect: dict
    source: str

    def peak_flops(self, precision: str) -> float:
        value = self.tflops.get(TFLOPS_KEY[precision])
        return (value if value is not None else self.tflops["float16"]) * 1e12

    def supports(self, precision: str) -> bool:
        return self.tflops.get(TFLOPS_KEY[precision]) is not None


def gpu_table() -> dict[str, dict]:
    data = json.loads(resources.files(__package__).joinpath("data/gpus.json").read_text())
    return {g["name"]: g for g in data["gpus"]}


def find_gpu(name: str) -> Gpu:
    table = gpu_table()
    key = name.lower()
    for entry in table.values():
        if key == entry["name"].lower() or key in entry["aliases"]:
            return Gpu(entry["name"], entry["sm"], entry["memory_gb"] * GB, entry["bandwidth_gbps"] * GB,
                       entry["tflops"], entry["interconnect"], entry["source"])
    raise UserError(f"--gpu: unknown GPU {name!r}; valid: {', '.join(table)}")
