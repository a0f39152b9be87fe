"""The demo's tooling beside its thresholds: the embedded assets, planted regressions and ``fp8gate demo``."""
