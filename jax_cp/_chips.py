"""Published per-chip peaks of TPU generations, for step-time *estimates*.

Sources: the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/
v4, v5e, v5p, v6e, tpu7x): peak bf16 FLOP/s, HBM capacity and bandwidth, and the
"interchip interconnect BW" per chip (given in Gbps; stored here in bytes/s).
The ICI figure is the per-chip total; one mesh axis may use only part of the
links, so communication estimates from it are optimistic.
"""
from __future__ import annotations

import dataclasses

__all__ = ["Chip", "CHIPS", "chip_for"]

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """Peaks of one chip; ``devices_per_chip`` > 1 where JAX shows each core as a device.

    Attributes:
        name: the chip's name.
        device_kind: what ``jax.Device.device_kind`` says.
        bf16_flops: peak bf16 FLOP/s.
        hbm_bytes: HBM capacity in bytes.
        hbm_bandwidth: HBM bytes/s.
        ici_bandwidth: interconnect bytes/s, per chip.
        devices_per_chip: JAX devices per chip.
    """

    name: str
    device_kind: str
    bf16_flops: float  # FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, per chip
    devices_per_chip: int = 1

    def __post_init__(self):
        for field in ("bf16_flops", "hbm_bytes", "hbm_bandwidth", "ici_bandwidth", "devices_per_chip"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Chip {self.name}: {field}={getattr(self, field)} must be positive.")

    # Per JAX device (one TensorCore on v4 and TPU7x, which JAX shows as two devices a chip).
    @property
    def device_flops(self) -> float:
        return self.bf16_flops / self.devices_per_chip

    @property
    def device_hbm_bytes(self) -> int:
        return self.hbm_bytes // self.devices_per_chip

    @property
    def device_hbm_bandwidth(self) -> float:
        return self.hbm_bandwidth / self.devices_per_chip

    @property
    def device_ici_bandwidth(self) -> float:
        return self.ici_bandwidth / self.devices_per_chip


CHIPS = {
    c.name: c
    for c in (
        # v4: 275 TFLOP/s, 32 GiB HBM2 at 1200 GB/s; ICI 6 links x 50 GB/s. JAX shows 2 cores per chip.
        Chip(name="v4", device_kind="TPU v4", bf16_flops=275e12, hbm_bytes=32 * GiB,
             hbm_bandwidth=1200e9, ici_bandwidth=300e9, devices_per_chip=2),
        # v5e: 197 TFLOP/s, 16 GB HBM2 at 819 GB/s, ICI 1600 Gbps.
        Chip(name="v5e", device_kind="TPU v5 lite", bf16_flops=197e12, hbm_bytes=16 * GiB,
             hbm_bandwidth=819e9, ici_bandwidth=1600e9 / 8),
        # v5p: 459 TFLOP/s, 95 GB HBM2e at 2765 GB/s, ICI 4800 Gbps.
        Chip(name="v5p", device_kind="TPU v5", bf16_flops=459e12, hbm_bytes=95 * GiB,
             hbm_bandwidth=2765e9, ici_bandwidth=4800e9 / 8),
        # v6e (Trillium): 918 TFLOP/s, 32 GB HBM at 1640 GB/s, ICI 3584 Gbps.
        Chip(name="v6e", device_kind="TPU v6 lite", bf16_flops=918e12, hbm_bytes=32 * GiB,
             hbm_bandwidth=1640e9, ici_bandwidth=3584e9 / 8),
        # TPU7x (Ironwood), Google's published per-chip spec: 2307 TFLOP/s bf16 (4614 is the FP8 peak),
        # 192 GiB HBM3E at 7.37 TB/s, ICI 1.2 TB/s bidirectional. Two TensorCores a chip, each a JAX
        # device (libtpu's "tpu7x:4x4x4": 64 chips, 128 devices), so per device: half of each.
        Chip(name="tpu7x", device_kind="TPU7x", bf16_flops=2307e12, hbm_bytes=192 * GiB,
             hbm_bandwidth=7370e9, ici_bandwidth=1200e9, devices_per_chip=2),
    )
}


def chip_for(topology: str) -> Chip:
    """The chip of a topology name such as ``"v5e:4x4"`` (the part before ``:``).

    Args:
        topology: the topology name.

    Returns:
        The :class:`Chip`.

    Raises:
        ValueError: the chip is unknown.
    """
    name = topology.split(":", 1)[0].lower()
    if name not in CHIPS:
        raise ValueError(
            f"topology={topology!r}: unknown chip {name!r}; known chips are {sorted(CHIPS)} "
            "(e.g. topology='v5e:4x4')."
        )
    return CHIPS[name]
