"""One thresholds file being read (Reading) and one TOML table of it (Table).

A ConfigError names the file, the dotted key and what was expected. Every reader of the file's tables
(model_tables.py, measure_tables.py, task_tables.py, loader.py) is a Reading of the same file, sharing
the local checkpoints' config.json met so far (a candidate's vocabulary is checked against the baseline's,
and chunk_tokens = "max_model_len" reads the models' context).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable, Collection, TypeVar

from ..errors import ConfigError, UnsupportedEngine
from . import checks

_Names = TypeVar("_Names", bound=Collection[str])


class Reading:
    """What every table reader of one file needs: its errors, and paths resolved against its directory."""

    def __init__(self, label: str, base_dir: Path, model_configs: dict[str, dict[str, Any]]):
        self.label, self.base_dir = label, base_dir
        self.model_configs = model_configs  # local model path -> its config.json

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.label}: {where}: {message}")

    def vllm_names(self, where: str, read: Callable[[], _Names], what: str) -> _Names:
        """Names the installed vLLM knows (``read``), or one error when vLLM cannot say."""
        try:
            return read()
        except UnsupportedEngine as err:
            raise self.error(where, f"cannot check {what}: {err}") from None

    def model_ref(self, where: str, value: str) -> str:
        """A Hugging Face id, or a local path resolved against the TOML's directory."""
        local = self.resolve(value)
        if local.exists():
            return str(local)
        if value.startswith(("./", "../", "/", "~")) or value in (".", ".."):
            raise self.error(where, f"local path not found: {local}")
        if Path(value).exists():
            # vLLM would load it from the working directory, whichever that is on the runner.
            raise self.error(where, f"{value!r} exists in the working directory but not next to the thresholds "
                                    f"file ({local}); write a path relative to the thresholds file or an absolute one")
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(value)
        except HFValidationError as err:
            raise self.error(where, f"neither a local path ({local} not found) nor a Hugging Face id: {err}") from None
        return value

    def resolve(self, value: str) -> Path:
        return (self.base_dir / Path(value).expanduser()).resolve()

    def directory(self, where: str, value: str | None) -> Path | None:
        if not value:
            return None
        path = self.resolve(value)
        if not path.is_dir():
            raise self.error(where, f"directory not found: {path}")
        return path


class Table:
    """One TOML table being read: knows its dotted key and rejects unknown keys up front."""

    def __init__(self, reading: Reading, where: str, raw: Any, keys: Collection[str]):
        self.reading, self.where = reading, where
        if not isinstance(raw, dict):
            raise reading.error(where, f"expected a table, got {checks.show(raw)}")
        for key in raw:
            if key not in keys:
                raise reading.error(self.key(key), "unknown key; " + checks.suggest_key(key, keys))
        self.raw: dict[str, Any] = raw

    def key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, check: checks.Check, default: Any = MISSING) -> Any:
        if key not in self.raw:
            if default is MISSING:
                raise self.reading.error(self.key(key), "missing required key")
            return default
        try:
            return check(self.raw[key])
        except ValueError as err:
            raise self.reading.error(self.key(key), str(err)) from None

    def values(self, cls: type, key_checks: dict[str, checks.Check]) -> dict[str, Any]:
        """Checked values of `key_checks`' keys; an absent key takes `cls`'s field default or is required."""
        defaults = {f.name: f.default for f in fields(cls)}
        return {key: self.get(key, check, defaults[key]) for key, check in key_checks.items()}

    def table(self, key: str, keys: Collection[str]) -> Table:
        return Table(self.reading, self.key(key), self.raw.get(key, {}), keys)

    def array_of_tables(self, key: str) -> list[Any]:
        value = self.raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.reading.error(self.key(key),
                                     f"expected an array of tables ([[{key}]]), got {checks.show(value)}")
        return value

