"""``fp8gate check THRESHOLDS``: every check of a thresholds file that needs no engine, in seconds.

The loader's checks (keys, values, local paths, the installed vLLM's engine keys and variable names)
come first: a file it refuses has that one problem. A file it reads is then checked as the run's
first engine start would check it (run/preflight.py: key variables, the Hugging Face cache offline,
the GPU count where this host shows GPUs), its task names against lm-eval's task index, and each
model's roofline where its weights or config are on this machine: a byte model that fails, or weights
that do not fit the GPUs the model is given. Notes say what the file resolves to (which card a GPU
name means, each model's roofline), for the reader to confirm.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .. import checkpoint, gpu_bandwidths, hardware
from ..config.loader import load_config
from ..config.spec import GateConfig, ModelSpec
from ..core import roofline
from ..errors import ConfigError, RooflineError
from ..run import preflight
from ..run.record import Needs


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)  # each one line: the file, the key, what was expected
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return {"problems": self.problems, "notes": self.notes}


def check_thresholds(path: Path | str) -> Findings:
    """Every check of the thresholds file at ``path`` that starts no engine."""
    try:
        gate = load_config(path)
    except ConfigError as err:
        return Findings([str(err)])
    findings = Findings()
    every = {spec.name: Needs() for spec in gate.candidates}  # each candidate as if its rules were selected
    findings.problems += preflight.key_problems(gate, every)
    hub = preflight.hub_problem(gate, every)
    if hub:
        findings.problems.append(hub)
    _gpu_count(gate, every, findings)
    if gate.tasks:
        from ..run import lm_tasks

        index = lm_tasks.TaskNames(gate.tasks)
        findings.problems += lm_tasks.task_name_problems(gate, index, index.names)
    _speed(gate, findings)
    return findings


def _gpu_count(gate: GateConfig, every: dict[str, Needs], findings: Findings) -> None:
    """The parallel sizes against this host's GPUs, where it shows any (a laptop checking a runner's file
    has none to count)."""
    wanted = any(int(spec.engine.get(key, 1)) > 1 for spec in (gate.baseline, *gate.candidates)
                 for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    if gate.device != "cuda" or not wanted:
        return
    visible = _visible_gpus()
    if not visible:
        findings.notes.append(f"{gate.path}: the parallel sizes are not checked against GPUs: this host shows none")
        return
    problem = preflight.parallelism_problem(gate, len(visible), every)
    if problem:
        findings.problems.append(problem)


def _visible_gpus() -> list[str]:
    """This host's GPUs by nvidia-smi; none without it (the run's probe would import torch, seconds, for the
    rare GPU that nvidia-smi cannot name)."""
    return hardware.cuda_device_names() if shutil.which("nvidia-smi") else []


def _speed(gate: GateConfig, findings: Findings) -> None:
    """Which card speed.gpu means, and each model's roofline on it."""
    if gate.speed is None:
        return
    gpu = gate.speed.gpu
    if gpu == "auto":
        visible = _visible_gpus() if gate.device == "cuda" else []
        gpu = visible[0] if visible else ""
        if not gpu:
            findings.notes.append(f'{gate.path}: speed.gpu: "auto" looks up the GPU the run finds; this host shows '
                                  "none")
    match = gpu_bandwidths.describe_match(gpu) if gpu else None
    if match:
        findings.notes.append(f"{gate.path}: speed.gpu: {match}")
    bandwidth = gate.speed.bandwidth_gbps or None
    for where, spec in {"baseline": gate.baseline, **{f"candidates[{i}]": c for i, c in
                                                      enumerate(gate.candidates)}}.items():
        _roofline(gate, where, spec, gpu or None, bandwidth, findings)


def _roofline(gate: GateConfig, where: str, spec: ModelSpec, gpu: str | None, bandwidth: float | None,
              findings: Findings) -> None:
    try:
        weights = checkpoint.weights_dir(spec.model)
    except Exception:  # a hub id not in the local cache: the engine downloads it, the roofline waits for that
        findings.notes.append(f"{gate.path}: {where}: no roofline before {spec.model} is on this machine")
        return
    parallel = int(spec.engine.get("tensor_parallel_size", 1))
    speed = gate.speed
    assert speed is not None
    try:
        estimate = roofline.estimate_from_path(
            weights, quantization=spec.quantization, gpu=gpu, bandwidth_gbps=bandwidth,
            context_tokens=roofline.decode_context_tokens(speed.input_len, speed.output_len),
            kv_cache_dtype=spec.engine.get("kv_cache_dtype"), batch=speed.batch_size)
    except RooflineError as err:
        findings.problems.append(f"{gate.path}: {where}: the speed rule's roofline: {err}")
        return
    ceiling = estimate.ceiling_tok_s
    on = f", {ceiling * parallel:.1f} tok/s ceiling on {parallel} x {estimate.gpu}" if ceiling else ""
    per_token = estimate.bytes_per_step / estimate.batch / 1e9
    findings.notes.append(f"{gate.path}: {where}: roofline {estimate.weight_bytes / 1e9:.3g} GB of weights "
                          f"({estimate.quantization or 'as stored'}), {per_token:.3g} GB read per decoded token{on}")
    crowded = roofline.weights_overflow(estimate, parallel)
    if crowded:
        key = "serve: --tensor-parallel-size" if spec.served is not None else "engine.tensor_parallel_size"
        findings.problems.append(f"{gate.path}: {where}.{key}: {crowded}")

