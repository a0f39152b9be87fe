"""A visible GPU's memory bandwidth: the datasheet table's figure, else NVML's (memory clock x bus width),
read through the NVML binding vLLM vendors (``vllm.third_party.pynvml``), else ``pynvml``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from .. import gpu_bandwidths
from ..hardware import resolve_gpu_name


def detected_bandwidth(gpu: str) -> tuple[str, float] | None:
    """The GPU named by ``speed.gpu`` ("auto": the visible one) and its GB/s from the table, else
    (a visible GPU the table lacks) from NVML's memory clock x bus width."""
    name = resolve_gpu_name(gpu)
    entry = gpu_bandwidths.find_gpu(name) if name else None
    if entry is not None:
        return entry.name, entry.bandwidth_gbps
    if name is not None and gpu == "auto":
        gbps, how = nvml_bandwidth_gbps()
        if gbps is not None:
            return f"{name} ({how})", gbps
    return None


def nvml_bandwidth_gbps(index: int = 0) -> tuple[float | None, str]:
    """Peak memory bandwidth of CUDA device ``index`` from NVML: max memory clock x bus width x 2
    (double data rate) / 8, in decimal GB/s; None and why where NVML cannot say. Uses the NVML
    binding vLLM vendors (``vllm.third_party.pynvml``), else ``pynvml``. ``index`` counts NVML's
    devices, which follow CUDA_VISIBLE_DEVICES only where the first visible device is NVML's 0."""
    pynvml = _nvml_binding()
    if pynvml is None:
        return None, "no NVML binding (vllm.third_party.pynvml or pynvml)"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # no driver: pynvml raises its own NVMLError
        return None, f"NVML unavailable: {err}"
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
    except Exception as err:
        return None, f"NVML could not read the memory clock or bus width: {err}"
    finally:
        pynvml.nvmlShutdown()
    if not clock_mhz or not bus_bits:
        return None, f"NVML reported memory clock {clock_mhz} MHz, bus width {bus_bits} bits"
    return clock_mhz * 1e6 * 2 * bus_bits / 8 / 1e9, f"NVML: {clock_mhz} MHz x {bus_bits} bits x 2 / 8"


def _nvml_binding() -> Any | None:
    """The NVML binding vLLM vendors, loaded from its file, else ``pynvml``; None without either.

    From its file because ``import vllm.third_party`` runs vLLM's package import, which imports torch
    (6 s on 2 CPU cores). Charged to whoever asked first: a cached baseline's speed inputs took 10.1 s on
    an H100 in a warm run, 0.6 s in a cold one where vLLM was already in (issue 33). The file is a
    self-contained ctypes binding."""
    found = importlib.util.find_spec("vllm")  # finds the package without importing it
    for folder in (found.submodule_search_locations or []) if found is not None else []:
        path = Path(folder) / "third_party" / "pynvml.py"
        spec = importlib.util.spec_from_file_location("fp8gate_vllm_pynvml", path) if path.is_file() else None
        if spec is not None and spec.loader is not None:
            if spec.name not in sys.modules:  # the binding finds itself there while it loads
                sys.modules[spec.name] = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(sys.modules[spec.name])
                except Exception:  # a binding that cannot load here: as if there were none
                    del sys.modules[spec.name]
                    break
            return sys.modules[spec.name]
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return pynvml


NVML_DISAGREEMENT = 0.10  # share of the table's figure beyond which NVML's is reported next to it


def nvml_disagreement(table_gbps: float, index: int = 0) -> str | None:
    """A warning when NVML's bandwidth of the device differs from the table's by more than 10%."""
    gbps, how = nvml_bandwidth_gbps(index)
    if gbps is None or abs(gbps - table_gbps) <= NVML_DISAGREEMENT * table_gbps:
        return None
    return (f"WARNING: NVML gives {gbps:,.0f} GB/s for this device ({how}), {abs(gbps / table_gbps - 1):.0%} "
            f"from the table's {table_gbps:,.0f} GB/s; set speed.bandwidth_gbps to the figure you trust")
