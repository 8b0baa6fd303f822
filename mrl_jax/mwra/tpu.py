"""TPU topologies to compile for from a machine without a TPU (libtpu's deviceless compiler).

With libtpu installed, ``jax.experimental.topologies.get_topology_desc`` gives the devices of a named TPU slice;
programs lowered with shardings on them compile with XLA:TPU and report its exact per-device memory, and nothing
is allocated. `resolve` accepts the names users type (``v5e-8``, ``v5p-16``, ``v6e-8``, ``v4-8``: the number
counts chips for v5e / v6e and TensorCores for v4 / v5p, as Cloud TPU names them) and topology strings
(``v5e:2x4``, ``v5p:2x2x1``).

    topo = resolve("v5e-8")           # Topology(name="v5e-8", topology="v5e:2x4", chips=8, hbm_per_chip=16 GiB)
    devices = topo.devices()          # 8 TPU v5 lite devices, for Mesh / NamedSharding / .lower().compile()
    topo.hbm_per_device               # the per-device limit the memory plan checks against

`quiet_default_backend` keeps the ``mrl`` verbs that ask for no topology from initialising libtpu on a machine
that has no TPU chip (libtpu then prints init errors and costs about a second at start).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from pathlib import Path

_GIB = 1 << 30

# generation -> (HBM bytes per chip, TensorCores per chip in the Cloud TPU name, dimensions of the topology)
_GENERATIONS = {
    "v4": (32 * _GIB, 2, 3),
    "v5e": (16 * _GIB, 1, 2),
    "v5p": (95 * _GIB, 2, 3),
    "v6e": (32 * _GIB, 1, 2),
}
_ACCELERATOR_PREFIX = {"v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}
_CHIPS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_CHIPS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
LIBTPU_INSTALL = 'pip install "jax[tpu]"  (libtpu: the TPU compiler; no TPU needed)'


class TopologyError(ValueError):
    """An unknown topology name, a layout libtpu refuses, or no libtpu to compile with; the message is one line
    with the fix."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice: the name asked for, libtpu's topology string, chips and HBM per chip (bytes)."""

    name: str
    topology: str
    generation: str
    chips: int
    hbm_per_chip: int

    @property
    def accelerator_type(self) -> str:
        """The Cloud TPU accelerator type (``v5litepod-8``, ``v5p-8``)."""
        cores = self.chips * _GENERATIONS[self.generation][1]
        return f"{_ACCELERATOR_PREFIX[self.generation]}-{cores}"

    def devices(self) -> list:
        """The slice's devices (``jax.Device`` objects to compile for; none can hold an array)."""
        if importlib.util.find_spec("libtpu") is None:
            raise TopologyError(f"compiling for TPU topology {self.name!r} needs libtpu; install it with: "
                                f"{LIBTPU_INSTALL}")
        # No metadata server here: libtpu otherwise prints init errors; several compiling processes (pytest
        # workers) may load it at once.
        for var, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                           ("TPU_ACCELERATOR_TYPE", self.accelerator_type), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
            os.environ.setdefault(var, value)
        try:
            return list(_topology_devices(self.topology, self.chips == 1))
        except Exception as e:  # noqa: BLE001 -- libtpu's parser raises JaxRuntimeError (and may raise others)
            reason = (str(e).splitlines() or [""])[0]
            raise TopologyError(f"libtpu cannot lay out TPU topology {self.name!r} ({type(e).__name__}: {reason}); "
                                "use a slice name such as v5e-8 or v5p-16, or a topology string whose first two sides "
                                "are even (a host holds 2x2 chips), such as v5e:2x4 or v5p:2x2x1") from None

    @property
    def hbm_per_device(self) -> int:
        """HBM per JAX device: a chip's, shared by its devices where libtpu shows a chip's cores apart (v4)."""
        return self.hbm_per_chip * self.chips // len(self.devices())

    def to_dict(self) -> dict:
        return {"name": self.name, "topology": self.topology, "accelerator_type": self.accelerator_type,
                "chips": self.chips, "hbm_per_chip_bytes": self.hbm_per_chip}


@functools.lru_cache(maxsize=None)
def _topology_devices(topology: str, single_chip: bool) -> tuple:
    from jax.experimental import topologies

    hosts = {"chips_per_host_bounds": (1, 1, 1)} if single_chip else {}   # the default host is 2x2 chips
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu", **hosts).devices)


def known_names() -> list[str]:
    """Every slice name `resolve` accepts by count (``v5e-8`` ...), smallest first per generation."""
    out = []
    for gen, (_, cores, dims) in _GENERATIONS.items():
        out += [f"{gen}-{chips * cores}" for chips in (_CHIPS_2D if dims == 2 else _CHIPS_3D)]
    return out


def _unknown(name: str) -> TopologyError:
    return TopologyError(f"unknown TPU topology {name!r}; use a slice name ({', '.join(known_names())}) or a "
                         "topology string such as v5e:2x4 or v5p:2x2x1")


def resolve(name: str) -> Topology:
    """``name`` (``v5e-8`` or ``v5e:2x4``, case-insensitive) as a `Topology`; `TopologyError` when unknown."""
    text = name.strip().lower().replace("v5litepod", "v5e").replace("v5lite", "v5e")
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", text)
    if m:
        gen, count = m.group(1), int(m.group(2))
        hbm, cores, dims = _GENERATIONS[gen]
        table = _CHIPS_2D if dims == 2 else _CHIPS_3D
        if count % cores or count // cores not in table:
            raise _unknown(name)
        chips = count // cores
        return Topology(name=name, topology=f"{gen}:{table[chips]}", generation=gen, chips=chips, hbm_per_chip=hbm)
    m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)", text)
    if m and len(m.group(2).split("x")) == _GENERATIONS[m.group(1)][2]:
        gen = m.group(1)
        chips = math.prod(int(x) for x in m.group(2).split("x"))
        return Topology(name=name, topology=text, generation=gen, chips=chips, hbm_per_chip=_GENERATIONS[gen][0])
    raise _unknown(name)


def _tpu_chip_present() -> bool:
    """Whether a Google TPU chip is on this machine's PCI bus (vendor 0x1ae0), as libtpu and JAX detect it."""
    try:
        return any(p.read_text().strip() == "0x1ae0" for p in Path("/sys/bus/pci/devices").glob("*/vendor"))
    except OSError:
        return False


def quiet_default_backend() -> None:
    """Keep JAX from initialising the TPU backend where libtpu is installed but neither a TPU chip nor a GPU
    plugin is present (``JAX_PLATFORMS=cpu``); a set ``JAX_PLATFORMS`` is left alone. Call before JAX's first
    backend use. Compiling for a topology (`Topology.devices`) works either way."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None or _tpu_chip_present():
        return
    from importlib.metadata import entry_points

    if not any(ep for ep in entry_points(group="jax_plugins")):
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax   # already imported with this package: its flag read the environment before

        jax.config.update("jax_platforms", "cpu")


__all__ = ["LIBTPU_INSTALL", "Topology", "TopologyError", "known_names", "quiet_default_backend", "resolve"]
