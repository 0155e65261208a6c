"""The host tier's memory: one buffer of fixed-size slots, pinned for DMA when the engine is on CUDA.

Slot ``s`` is bytes ``[s * slot_bytes, (s + 1) * slot_bytes)`` of the buffer and holds one
offloaded block of every tensor of its group (see :class:`~kvoffload.worker.layout.GroupLayout`),
so one block moves in a few large copies.

The buffer is a plain allocation of exactly ``num_slots * slot_bytes`` bytes, pinned afterwards
with ``cudaHostRegister``. PyTorch's ``pin_memory=True`` would route it through the pinned caching
allocator, which rounds every allocation up to a power of two (vLLM #53042: 1.9x host memory).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from kvoffload.errors import ConfigError, HostAllocationError

__all__ = ["HostPool", "HostSlots", "num_host_blocks"]

logger = logging.getLogger(__name__)


def num_host_blocks(size_bytes: int, bytes_per_offloaded_block: int) -> int:
    """How many offloaded blocks a host budget of ``size_bytes`` holds.

    Raises :class:`ConfigError` when the budget does not hold a single block.
    """
    if bytes_per_offloaded_block <= 0:
        raise ConfigError(
            "bytes_per_offloaded_block", f"must be positive, got {bytes_per_offloaded_block}"
        )
    blocks = size_bytes // bytes_per_offloaded_block
    if blocks < 1:
        raise ConfigError(
            "kv_offloading_size",
            f"{size_bytes} bytes ({size_bytes / 2**30:.3f} GiB) do not hold one offloaded block of "
            f"{bytes_per_offloaded_block} bytes",
        )
    return blocks


class HostSlots(Protocol):
    """Host memory a copy handler writes: ``num_slots`` slots, slot ``s`` at
    ``address + s * slot_stride``, all inside ``[address, address + nbytes)``."""

    num_slots: int
    nbytes: int

    @property
    def address(self) -> int: ...

    @property
    def slot_stride(self) -> int: ...


def _cuda_status(result: object) -> int:
    """cudart calls return an enum (or a tuple starting with one); 0 is success."""
    if isinstance(result, tuple):
        result = result[0]
    return int(getattr(result, "value", result))  # type: ignore[call-overload]  # an enum or int


class HostPool:
    """``num_slots`` slots of ``slot_bytes`` bytes in one host buffer.

    ``buffer`` is the flat uint8 tensor, ``slots`` its ``(num_slots, slot_bytes)`` view. With
    ``pin=True`` the buffer is page-locked with ``cudaHostRegister`` (needs CUDA) and unregistered
    by :meth:`close`. Allocation failures raise :class:`HostAllocationError` with the size asked.
    """

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ConfigError(
                "host_pool",
                f"needs at least one slot of at least one byte, got {num_slots} x {slot_bytes}",
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.nbytes = num_slots * slot_bytes
        if self.nbytes >= 2**63:
            raise HostAllocationError(self.nbytes, "larger than any address space")
        try:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise HostAllocationError(self.nbytes, str(exc).splitlines()[0]) from exc
        self.slots = self.buffer.view(num_slots, slot_bytes)
        self.pinned = False
        if pin:
            self._pin()

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            raise HostAllocationError(self.nbytes, "pinning needs CUDA, which is not available")
        status = _cuda_status(
            torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
        )
        if status != 0:
            raise HostAllocationError(
                self.nbytes, f"cudaHostRegister failed with CUDA error {status}"
            )
        self.pinned = True

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def slot_stride(self) -> int:
        """Slots lie back to back."""
        return self.slot_bytes

    def memoryview(self) -> memoryview:
        """The pool as a 2-D ``(num_slots, slot_bytes)`` byte view, for secondary tiers."""
        return self.slots.numpy().data  # the array's buffer, as memoryview(array)

    def close(self) -> None:
        """Unpin the buffer (when pinned). Idempotent; callers drop their views afterwards."""
        if self.pinned:
            self.pinned = False
            status = _cuda_status(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()))
            if status != 0:
                logger.warning(
                    "cudaHostUnregister of the %d-byte host pool failed with CUDA error %d",
                    self.nbytes,
                    status,
                )
