"""Which engine runs a model: the one place the backend is chosen."""

from __future__ import annotations

from ..config.spec import ModelSpec
from .base import Engine


def engine_class_for(spec: ModelSpec, injected: type[Engine]) -> type[Engine]:
    """A served model (``spec.served``: a ``vllm serve`` the gate starts or an endpoint) runs on
    ``ServedEngine``; any other on ``injected``, the class measuring was given (``VllmEngine`` unless a
    plugin or a test stands another in)."""
    if spec.served is not None:
        from .served_engine import ServedEngine  # the HTTP client only where a model is served

        return ServedEngine
    return injected
