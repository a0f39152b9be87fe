"""How the fp8gate plugin's options and ini keys (declared in plugin.py) are read into Settings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import DEFAULT_CONFIG_NAME, REQUIRE_GPU_ENV, progress

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


# How the thresholds file was chosen; only one found in rootdir is implicit.
SOURCE_OPTION = "--fp8gate-config"
SOURCE_INI = "the fp8gate_config ini key"
SOURCE_ROOTDIR = f"{DEFAULT_CONFIG_NAME} found in rootdir"
# vLLM's cache root (vllm/envs.py): its torch.compile cache, Inductor's and Triton's caches live under it,
# keyed by vLLM's hash of the settings, code and compiler, not by this path (VLLM_CACHE_ROOT is left out).
COMPILE_CACHE_ENV = "VLLM_CACHE_ROOT"
COMPILE_CACHE_DIR = "vllm-cache"  # the default's folder inside the baseline cache


@dataclass(frozen=True)
class Settings:
    config_path: Path | None  # absolute; None when none was given and rootdir has none
    require_gpu: bool
    artifacts: Path | None  # absolute; None when not asked for
    baseline_cache: Path | None = None  # absolute; None: the baseline is measured every session
    update_baseline: bool = False  # re-measure the baseline and replace its cache entry
    report: Path | None = None  # markdown report (plots next to it); None: only $GITHUB_STEP_SUMMARY
    allow_no_rules: bool = False  # a run may select none of the file's rules
    config_source: str | None = None  # SOURCE_*; None without a file
    request_deadline_s: float | None = None  # every served model's, over the thresholds file's; None: the file's
    compile_cache: Path | None = None  # absolute; vLLM's cache root for every engine and server; None: vLLM's own
    candidates: tuple[str, ...] = ()  # --fp8gate-candidate: the candidates judged; (): every one in the file
    baseline_only: bool = False  # measure or restore the baseline, judge no candidate
    progress_interval_s: float = progress.DEFAULT_INTERVAL_S  # a long pass's progress line every this; 0: none
    cache_wait_s: float | None = None  # for another run measuring the same baseline entry; None: the cache's default

    @property
    def config_explicit(self) -> bool:
        return self.config_source in (SOURCE_OPTION, SOURCE_INI)



def read_settings(config: pytest.Config) -> Settings:
    """Settings from the command line, else the environment or ini file, else defaults."""
    config_path = _path_option(config, "fp8gate_config")
    baseline_cache = _path_option(config, "fp8gate_baseline_cache")
    update_baseline = bool(config.getoption("fp8gate_update_baseline"))
    if update_baseline and baseline_cache is None:
        raise pytest.UsageError("--fp8gate-update-baseline needs a cache: --fp8gate-baseline-cache DIR "
                                "(or the fp8gate_baseline_cache ini key)")
    if config.getoption("fp8gate_baseline_only") and baseline_cache is None:
        raise pytest.UsageError("--fp8gate-baseline-only needs a cache to keep the baseline in: "
                                "--fp8gate-baseline-cache DIR (or the fp8gate_baseline_cache ini key)")
    if baseline_cache is not None and baseline_cache.exists() and not baseline_cache.is_dir():
        raise pytest.UsageError(f"--fp8gate-baseline-cache {display_path(baseline_cache)}: not a directory")
    compile_cache = _compile_cache(config, baseline_cache)
    report = _path_option(config, "fp8gate_report")
    if report is not None and report.is_dir():
        raise pytest.UsageError(f"--fp8gate-report {display_path(report)}: is a directory, expected a file path")
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
        baseline_cache=baseline_cache,
        update_baseline=update_baseline,
        report=report,
        allow_no_rules=bool(config.getoption("fp8gate_allow_no_rules"))
        or bool(config.getini("fp8gate_allow_no_rules")),
        config_source=source,
        request_deadline_s=_seconds_option(config, "fp8gate_request_deadline", "--fp8gate-request-deadline"),
        compile_cache=compile_cache,
        candidates=_names_option(config.getoption("fp8gate_candidate")),
        baseline_only=bool(config.getoption("fp8gate_baseline_only")),
        cache_wait_s=_cache_wait(config),
        progress_interval_s=_progress_interval(config),
    )


def _names_option(given: list[str]) -> tuple[str, ...]:
    """Names given as repeated options or comma lists, in order, once each."""
    return tuple(dict.fromkeys(name.strip() for value in given for name in value.split(",") if name.strip()))


def _progress_interval(config: pytest.Config) -> float:
    given = _seconds_option(config, "fp8gate_progress_interval", "--fp8gate-progress-interval",
                            zero="no progress lines")
    return progress.DEFAULT_INTERVAL_S if given is None else given


_CACHE_WAIT_ZERO = "do not wait"  # what 0 means, in its bad-value message


def _cache_wait(config: pytest.Config) -> float | None:
    """--fp8gate-cache-wait, else the ini key: seconds, 0 (do not wait) or more."""
    if config.getoption("fp8gate_cache_wait") is not None:
        return _seconds_option(config, "fp8gate_cache_wait", "--fp8gate-cache-wait", zero=_CACHE_WAIT_ZERO)
    given = config.getini("fp8gate_cache_wait")
    return _seconds(given, "the fp8gate_cache_wait ini key", zero=_CACHE_WAIT_ZERO) if given else None


def _compile_cache(config: pytest.Config, baseline_cache: Path | None) -> Path | None:
    """Where vLLM keeps its compiled graphs: the option or ini key, else a folder in the baseline cache
    (kept by whoever keeps that), unless the environment already names vLLM's cache root."""
    given = _path_option(config, "fp8gate_compile_cache")
    if given is None and baseline_cache is not None and COMPILE_CACHE_ENV not in os.environ:
        given = baseline_cache / COMPILE_CACHE_DIR
    if given is not None and given.exists() and not given.is_dir():
        raise pytest.UsageError(f"--fp8gate-compile-cache {display_path(given)}: not a directory")
    return given


def _seconds_option(config: pytest.Config, name: str, flag: str, zero: str | None = None) -> float | None:
    given = config.getoption(name)
    return None if given is None else _seconds(given, flag, zero)


def _seconds(given: str, flag: str, zero: str | None) -> float:
    """``given`` as seconds above 0 (or 0 too, where ``zero`` says what 0 means), else one usage error naming
    ``flag``."""
    try:
        seconds = float(given)
    except ValueError:
        seconds = float("nan")
    if not (seconds >= 0 if zero is not None else seconds > 0) or seconds == float("inf"):
        bound = f" of 0 or more (0: {zero})" if zero is not None else " above 0"
        raise pytest.UsageError(f"{flag} {given}: expected a number of seconds{bound}")
    return seconds


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
