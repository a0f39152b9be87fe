"""One family of errors: every error of the gate's own reaches the user as one line, never a traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import pytest_fp8gate
from fakes import write_recorded_gate
from pytest_fp8gate import errors
from pytest_fp8gate.core import roofline
from pytest_fp8gate.tools.cli import EXIT_ERROR, EXIT_FAILURE, main

ERRORS = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
          if issubclass(cls, BaseException) and cls.__module__ == errors.__name__]


def _modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(pytest_fp8gate.__path__, "pytest_fp8gate.")]


def test_every_error_the_package_defines_is_in_errors_and_derives_from_the_base() -> None:
    defined = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name and not cls.__name__.startswith("_"):
                defined[cls.__name__] = name
    assert set(defined.values()) == {"pytest_fp8gate.errors"}
    assert all(issubclass(cls, errors.Fp8GateError) for cls in ERRORS)
    assert len(ERRORS) > 10


def _instance(cls: type[errors.Fp8GateError]) -> errors.Fp8GateError:
    if cls is errors.DumpFormatError:
        return cls("run.npz", "expected an fp8gate .npz dump")
    return cls("model_dir: what went wrong, in one line")


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_the_cli_prints_any_of_them_as_one_line(cls, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    error = _instance(cls)

    def estimate_from_path(path, **kwargs):
        raise error

    monkeypatch.setattr(roofline, "estimate_from_path", estimate_from_path)
    code = main(["roofline", "model_dir"])
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"fp8gate: error: {error}\n"
    assert code == (EXIT_ERROR if cls.usage_error else EXIT_FAILURE)


def test_usage_errors_are_what_the_user_gave() -> None:
    usage = {cls.__name__ for cls in ERRORS if cls.usage_error}
    assert usage == {"ConfigError", "CommandError", "CheckpointError", "QuantizeError", "ComparisonError",
                     "RooflineError", "DumpFormatError"}


ENFORCE_TEST = """
import pytest
from pytest_fp8gate import errors
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.face.session import GateSession

@pytest.mark.parametrize("name", {names!r})
def test_rule(pytestconfig, tmp_path, request, monkeypatch, name):
    session = GateSession(pytestconfig, load_config({config!r}), tmp_path)
    error = getattr(errors, name)
    def evaluate(case):
        raise error("run.npz", "expected a dump") if error is errors.DumpFormatError else error(f"{{name}}: one line")
    monkeypatch.setattr(session.gate, "evaluate", evaluate)
    session.enforce(Case("mean_kl", "fp8"), request.node)
"""


def test_a_rule_that_raises_any_of_them_fails_with_its_line(pytester: pytest.Pytester, tmp_path: Path) -> None:
    names = [cls.__name__ for cls in ERRORS if cls is not errors.Fp8GateError]
    pytester.makepyfile(ENFORCE_TEST.format(names=names, config=str(write_recorded_gate(tmp_path / "gate"))))
    # A gate option asks for the gate, so its settings exist for GateSession in a run with no rule test.
    result = pytester.runpytest("-p", "no:randomly", "--fp8gate-allow-no-rules")
    result.assert_outcomes(failed=len(names))
    lines = result.stdout.lines
    assert not any("Traceback" in line or "During handling" in line for line in lines)
    for name in names:
        header = next(i for i, line in enumerate(lines) if line.strip("_ ") == f"test_rule[{name}]")
        expected = "run.npz: expected a dump" if name == "DumpFormatError" else f"{name}: one line"
        assert lines[header + 1] == expected  # the failure's whole report is that line
        assert lines[header + 2].startswith(("_", "="))
