"""What machine this is, as far as speculation cares: the CPU's model and the ISA flags that decide
whether a forward over several tokens costs about one (AVX-512 bf16, AMX) or several (AVX2 only in
bf16), the GPU, the thread count."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# CPU features that decide what speculation can gain: without a fast bf16 matrix kernel (AVX-512
# bf16, AMX) a bf16 forward over several tokens costs several single-token forwards.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu() -> dict:
    """The CPU's model name and which of ISA_FLAGS it has (Linux's /proc/cpuinfo; "unknown" elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.processor() or "unknown", "isa": "unknown"}
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", "unknown"), "isa": [f for f in ISA_FLAGS if f in flags]}


def kernels() -> str:
    """The vector ISA PyTorch's CPU kernels dispatch to, and oneDNN's and MKL's caps where set: less than
    the CPU has when `ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` / `MKL_ENABLE_INSTRUCTIONS` say so (how an
    AVX2-only machine's costs are reproduced on a newer one: float32 matmuls run in MKL, bf16 ones in oneDNN)."""
    caps = [("oneDNN", os.environ.get("ONEDNN_MAX_CPU_ISA")), ("MKL", os.environ.get("MKL_ENABLE_INSTRUCTIONS"))]
    return ", ".join([f"torch {torch.backends.cpu.get_cpu_capability()}"] + [f"{n} {c}" for n, c in caps if c])


def describe(device: torch.device | str = "cpu") -> str:
    """One line naming the machine a model runs on: the GPU's name, or the CPU's model, its ISA flags,
    the kernels PyTorch uses on it and the thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = cpu()
    isa = " ".join(info["isa"]) if isinstance(info["isa"], list) else info["isa"]
    return f"{info['cpu']} [{isa or 'no avx2'}] ({kernels()}), {torch.get_num_threads()} threads"
