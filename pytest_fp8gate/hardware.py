"""Which CUDA devices this process can see, found without initialising CUDA if possible.

nvidia-smi is asked first: it is fast and leaves no CUDA context behind. It lists
every GPU on the host, so CUDA_VISIBLE_DEVICES is applied here the way the CUDA
runtime applies it. torch is the fallback and is imported only then (it takes
seconds, and the plugin must stay cheap to load); the names it gives are read in a child
process, since reading them creates a CUDA context.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

_SMI_TIMEOUT_S = 20


@dataclass(frozen=True)
class CudaProbe:
    names: tuple[str, ...]  # CUDA-reported names of the visible devices, in CUDA order
    source: str  # how they were found, for skip reasons and the report header


@functools.cache
def probe_cuda() -> CudaProbe:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    notes = []
    # MIG instance ids cannot be mapped to nvidia-smi's GPU rows; torch resolves them.
    if smi and "MIG-" not in (visible or ""):
        rows, failure = _nvidia_smi_rows(smi, "name")
        if rows is not None:
            names = _apply_visible(rows, visible)
            where = "nvidia-smi" if visible is None else f"nvidia-smi, CUDA_VISIBLE_DEVICES={visible!r}"
            return CudaProbe(names, where)
        notes.append(failure)
    elif not smi:
        notes.append("nvidia-smi not found")
    names, how = _torch_names()
    return CudaProbe(names, "; ".join([*notes, how]))


def cuda_device_names() -> list[str]:
    """Names of the visible CUDA devices, e.g. ["NVIDIA H100 80GB HBM3"]; [] without one."""
    return list(probe_cuda().names)


def resolve_gpu_name(name: str) -> str | None:
    """"auto": the first visible CUDA device's name (None without one); any other name as given."""
    if name != "auto":
        return name
    names = cuda_device_names()
    return names[0] if names else None


def cuda_free_memory_mib() -> list[int] | None:
    """Free memory of each visible CUDA device in MiB (nvidia-smi), None where it cannot tell.

    Read from outside the engine, so it counts what a child-process engine core
    still holds, and it creates no CUDA context in this process.
    """
    smi = shutil.which("nvidia-smi")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not smi or "MIG-" in (visible or ""):
        return None
    rows, _ = _nvidia_smi_rows(smi, "memory.free", "nounits")
    if rows is None:
        return None
    return [int(value) for value in _apply_visible(rows, visible)]


def _nvidia_smi_rows(smi: str, field: str, *formats: str) -> tuple[list[tuple[str, str, str]] | None, str]:
    """(index, uuid, field) per GPU, or None and why nvidia-smi could not say."""
    try:
        done = subprocess.run(
            [smi, f"--query-gpu=index,uuid,{field}", "--format=" + ",".join(["csv", "noheader", *formats])],
            capture_output=True,
            text=True,
            timeout=_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"nvidia-smi failed: {err}"
    if done.returncode != 0:
        detail = (done.stdout + done.stderr).strip().splitlines()
        return None, f"nvidia-smi exited {done.returncode}: {detail[0] if detail else 'no output'}"
    rows = []
    for line in done.stdout.splitlines():
        parts = [part.strip() for part in line.split(",", 2)]
        if len(parts) == 3:
            rows.append((parts[0], parts[1], parts[2]))
    return rows, ""


def _apply_visible(rows: list[tuple[str, str, str]], visible: str | None) -> tuple[str, ...]:
    """The third column of the visible devices' rows, read the way the CUDA runtime reads
    CUDA_VISIBLE_DEVICES: indices or GPU-uuid prefixes, in the order given, stopping
    at the first entry that matches nothing."""
    if visible is None:
        return tuple(name for _, _, name in rows)
    names = []
    for entry in (part.strip() for part in visible.split(",")):
        match = next((name for index, uuid, name in rows if _selects(entry, index, uuid)), None)
        if match is None:
            break
        names.append(match)
    return tuple(names)


def _selects(entry: str, index: str, uuid: str) -> bool:
    return entry == index or (entry.startswith("GPU-") and uuid.startswith(entry))


def _torch_names() -> tuple[tuple[str, ...], str]:
    try:
        import torch
    except ImportError:
        return (), "torch not installed"
    except Exception as err:  # a broken torch build must not break collection; no GPU is usable then
        return (), f"importing torch failed: {err}"
    try:
        count = torch.cuda.device_count()  # does not create a CUDA context
    except RuntimeError as err:  # a broken driver or CUDA install: no usable device
        return (), f"torch.cuda failed: {err}"
    if not count:
        return (), "torch.cuda.device_count() = 0"
    return _torch_names_in_child(count)


# Reading a device's name creates a CUDA context. In the gate's process that context would make vLLM
# spawn every engine core instead of forking it (20-30 s more a start on an H100), so a child reads them.
_TORCH_NAMES = ("import json, torch; "
                "print(json.dumps([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]))")
_TORCH_NAMES_TIMEOUT_S = 120


def _torch_names_in_child(count: int) -> tuple[tuple[str, ...], str]:
    how = f"torch.cuda.device_count() = {count}, names read in a child process"
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_NAMES], capture_output=True, text=True,
                              timeout=_TORCH_NAMES_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return (), f"{how}: no answer within {_TORCH_NAMES_TIMEOUT_S} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return (), f"{how}: torch.cuda failed: {last}"
    try:
        return tuple(json.loads(done.stdout.strip().splitlines()[-1])), how
    except (IndexError, ValueError):
        return (), f"{how}: unreadable answer {done.stdout.strip()[-200:]!r}"
