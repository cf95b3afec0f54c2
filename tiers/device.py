"""G1: device memory. Real GPU memory on a CUDA host; CPU tensors stand in elsewhere (tests say so)."""

from __future__ import annotations

import torch

from kvbm.tiers.pool import SlotPoolTier


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` is the current CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
    return dev


class DeviceTier(SlotPoolTier):
    """A slot pool allocated once in device memory."""

    name = "G1"
    kind = "device"

    def __init__(self, capacity_bytes: int, slot_bytes: int, device: str = "auto") -> None:
        self.device = resolve_device(device)
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"G1 capacity {capacity_bytes} B holds no {slot_bytes}-byte block")
        super().__init__(torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=self.device), slot_bytes)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["device"] = str(self.device)
        return d
