"""The engine backends by name: for each ``backend`` a thresholds file may name (``config.spec.BACKENDS``),
the engine class that runs a model in this process and the one that runs a served model.

Each class is named as "module:Class" inside this package and imported only when a model asks for it,
so that naming a backend costs nothing until its engine starts (vLLM itself, the HTTP client). A plugin
or a conftest supplies a class of its own through the ``pytest_fp8gate_engine_class`` hook instead
(``face/hookspecs.py``); a backend of this package is one module, one row here and its name in BACKENDS.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..config.spec import ModelSpec
from ..errors import ConfigError
from .base import Engine


@dataclass(frozen=True)
class Backend:
    in_process: str | None  # "module:Class" of the engine in this process; None: the backend only serves
    served: str | None  # "module:Class" of the engine over a server the gate starts or is given; None: none


REGISTRY: dict[str, Backend] = {
    "vllm": Backend(in_process="vllm_engine:VllmEngine", served="vllm_served:VllmServedEngine"),
}


def engine_class(spec: ModelSpec) -> type[Engine]:
    """The class of ``spec.backend``'s row that runs ``spec``: its served engine for a served model (``serve``
    or ``endpoint``), its in-process one otherwise."""
    row = REGISTRY[spec.backend]  # the loader admits only the names of BACKENDS, each a row here
    served = spec.served is not None
    where = row.served if served else row.in_process
    if where is None:
        fix = "run it in-process (no serve or endpoint)" if served else "give serve or endpoint"
        raise ConfigError(f"{spec.name}: backend {spec.backend!r} has no {'served' if served else 'in-process'} "
                          f"engine; {fix}, or name another backend")
    module, _, name = where.partition(":")
    found: type[Engine] = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return found
