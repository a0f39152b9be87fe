"""Options, ini keys and stash keys of the fp8gate plugin, and how they are read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from .config import GateConfig

DEFAULT_CONFIG_NAME = "thresholds.toml"
REQUIRE_GPU_ENV = "FP8GATE_REQUIRE_GPU"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


# How the thresholds file was chosen; only one found in rootdir is implicit.
SOURCE_OPTION = "--fp8gate-config"
SOURCE_INI = "the fp8gate_config ini key"
SOURCE_ROOTDIR = f"{DEFAULT_CONFIG_NAME} found in rootdir"


@dataclass(frozen=True)
class Settings:
    config_path: Path | None  # absolute; None when none was given and rootdir has none
    require_gpu: bool
    artifacts: Path | None  # absolute; None when not asked for
    allow_no_rules: bool = False  # a run may select none of the file's rules
    config_source: str | None = None  # SOURCE_*; None without a file

    @property
    def config_explicit(self) -> bool:
        return self.config_source in (SOURCE_OPTION, SOURCE_INI)


SETTINGS_KEY = pytest.StashKey[Settings]()
CONFIG_KEY = pytest.StashKey[GateConfig | None]()  # the loaded thresholds, None without a file


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8gate", "FP8 deploy gate")
    group.addoption(
        "--fp8gate-config",
        metavar="PATH",
        help=f"Thresholds TOML of the gate (default: {DEFAULT_CONFIG_NAME} in rootdir, when present)",
    )
    group.addoption(
        "--fp8gate-require-gpu",
        action="store_true",
        help=f"Error out instead of skipping gpu tests when no CUDA device is visible (also {REQUIRE_GPU_ENV}=1)",
    )
    group.addoption("--fp8gate-artifacts", metavar="DIR", help="Directory for the gate's run artifacts")
    group.addoption(
        "--fp8gate-allow-no-rules",
        action="store_true",
        help="Let a run with a thresholds file select none of its rules (by default that is an error)",
    )
    parser.addini("fp8gate_config", "Thresholds TOML of the gate, relative to the ini file")
    parser.addini("fp8gate_require_gpu", "Error out instead of skipping gpu tests without a CUDA device", type="bool")
    parser.addini("fp8gate_artifacts", "Directory for the gate's run artifacts, relative to the ini file")
    parser.addini("fp8gate_allow_no_rules", "Let a run select none of the thresholds file's rules", type="bool")


def read_settings(config: pytest.Config) -> Settings:
    """Settings from the command line, else the environment or ini file, else defaults."""
    config_path = _path_option(config, "fp8gate_config")
    source = None
    if config_path is not None:
        source = SOURCE_OPTION if config.getoption("fp8gate_config") else SOURCE_INI
    elif (config.rootpath / DEFAULT_CONFIG_NAME).is_file():
        config_path, source = config.rootpath / DEFAULT_CONFIG_NAME, SOURCE_ROOTDIR
    return Settings(
        config_path=config_path,
        require_gpu=bool(config.getoption("fp8gate_require_gpu"))
        or _env_flag(REQUIRE_GPU_ENV)
        or bool(config.getini("fp8gate_require_gpu")),
        artifacts=_writable_dir(_path_option(config, "fp8gate_artifacts")),
        allow_no_rules=bool(config.getoption("fp8gate_allow_no_rules"))
        or bool(config.getini("fp8gate_allow_no_rules")),
        config_source=source,
    )


def display_path(path: Path) -> Path:
    """A path as users typed it: relative to the working directory when inside it."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _path_option(config: pytest.Config, name: str) -> Path | None:
    # Command-line paths are relative to where pytest was invoked, ini paths to the ini file.
    given = config.getoption(name)
    if given:
        return (config.invocation_params.dir / Path(given).expanduser()).resolve()
    in_ini = config.getini(name)
    if in_ini:
        base = config.inipath.parent if config.inipath else config.rootpath
        return (base / Path(in_ini).expanduser()).resolve()
    return None


def _writable_dir(path: Path | None) -> Path | None:
    """The artifacts directory, refused now if the gate could not write there after its engines ran."""
    if path is None:
        return None
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise pytest.UsageError(f"--fp8gate-artifacts: {display_path(existing)} is a file, expected a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise pytest.UsageError(f"--fp8gate-artifacts: {display_path(existing)}: not writable")
    return path


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise pytest.UsageError(f"{name}={os.environ[name]!r}: expected 1 or 0 (or true/false)")
