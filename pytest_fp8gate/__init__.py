"""pytest-fp8gate: decide whether a quantized LLM build may replace its BF16 original."""

__version__ = "0.1.0"
