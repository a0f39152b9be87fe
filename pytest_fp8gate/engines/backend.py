"""Which engine runs a model: the one place the backend is chosen."""

from __future__ import annotations

from collections.abc import Callable

from ..config.spec import GateConfig, ModelSpec
from . import registry
from .base import Engine

# Asked for each model: the class that runs it, or None to leave it to the registry (the pytest hook's answer).
EngineChoice = Callable[[ModelSpec], "type[Engine] | None"]


def engine_class_for(spec: ModelSpec, injected: type[Engine] | EngineChoice | None = None) -> type[Engine]:
    """The class that runs ``spec``: ``injected`` where it gives one (a class stood in for every model, as the
    tests' fake engine, or a choice asked for this model, as the ``pytest_fp8gate_engine_class`` hook), else
    the registry's class for the model's ``backend``, served or in-process (engines/registry.py)."""
    if isinstance(injected, type):
        return injected
    chosen = injected(spec) if injected is not None else None
    return chosen if chosen is not None else registry.engine_class(spec)


def prepare_process(config: GateConfig, injected: type[Engine] | EngineChoice | None = None) -> None:
    """Once per session, before any engine starts: each class that runs one of ``config``'s models prepares
    the process for ``deterministic_scheduling``, once."""
    models = (config.baseline, *config.candidates)
    for engine_class in dict.fromkeys(engine_class_for(spec, injected) for spec in models):
        engine_class.prepare_process(config.deterministic_scheduling)
