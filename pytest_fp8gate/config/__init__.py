"""The thresholds.toml schema, its loader and its checks: no engine module."""
