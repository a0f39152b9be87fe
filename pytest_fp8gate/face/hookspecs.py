"""The gate's own pytest hooks, added by ``plugin.pytest_addhooks`` (as pytest-xdist adds its ``newhooks``).

Implement one in a ``conftest.py`` or a plugin; pytest checks the implementation's arguments against the
specification here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ..config.spec import ModelSpec
    from ..engines.base import Engine


@pytest.hookspec(firstresult=True)
def pytest_fp8gate_engine_class(spec: ModelSpec, config: pytest.Config) -> type[Engine] | None:
    """The engine class that runs the model ``spec`` (a subclass of ``pytest_fp8gate.engines.base.Engine``),
    or None to leave it to the registry: the class of the model's ``backend``, served or in-process.

    Asked whenever the gate needs the model's class: when the rule tests are collected (what the class
    refuses to run), before any engine starts (its process setup) and when the model's engine starts; answer
    alike each time. The first implementation that returns a class decides.

    :param spec: The model, as the thresholds file gives it (``spec.name``, ``spec.backend``, ``spec.served``).
    :param config: The pytest config.
    """
