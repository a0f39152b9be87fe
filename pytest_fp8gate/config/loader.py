"""Load thresholds.toml into the frozen dataclasses of spec.py.

The loader reads the TOML, walks its tables by schema.py's key tables and builds the GateConfig:
the model tables are read in model_tables.py (each candidate merged over the baseline), [noise],
[decode] and [probabilities] in measure_tables.py, [[tasks]] in task_tables.py, the top level,
[speed] and [load] here; the value checks and the checks across tables are in checks.py. Every
problem becomes one ConfigError whose message is a single line naming the file, the dotted key,
and what was expected, so pytest can print it as a usage error instead of a traceback. The schema
is documented in docs/thresholds.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .. import gpu_bandwidths
from ..core.budget import RUN_ALPHA
from ..errors import ConfigError
from . import checks, schema
from .measure_tables import MeasureTables
from .model_tables import ModelTables
from .reading import Reading, Table
from .spec import CPU_MIN_THROUGHPUT_FRACTION, GateConfig, LoadSpec, ModelSpec, SpeculativeSpec, SpeedSpec, TaskSpec
from .task_tables import TaskTables

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def load_config(path: Path | str) -> GateConfig:
    """Read and validate a thresholds TOML file; raise ConfigError on any problem."""
    path = Path(path)
    label = str(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{label}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{label}: is a directory, expected a TOML file") from None
    except OSError as err:
        raise ConfigError(f"{label}: cannot read: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{label}: invalid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label}: not UTF-8 text") from None
    return _Parser(label, path.resolve().parent).gate(raw, path.resolve())


class _Parser(Reading):
    """The top level of the file, [speed] and [load]; the other tables go to their own readers."""

    def __init__(self, label: str, base_dir: Path):
        super().__init__(label, base_dir, {})
        shared = (label, base_dir, self.model_configs)
        self.models, self.measures, self.tasks = ModelTables(*shared), MeasureTables(*shared), TaskTables(*shared)

    def gate(self, raw: dict[str, Any], path: Path) -> GateConfig:
        top = Table(self, "", raw, schema.TOP_KEYS)
        if "baseline" not in raw:
            raise self.error("baseline", "missing required table [baseline]")
        baseline = self.models.model_spec(top.table("baseline", schema.MODEL_KEYS), None)
        candidate_tables = top.array_of_tables("candidates")
        if not candidate_tables:
            raise self.error("candidates", "expected at least one [[candidates]] table")
        candidates = tuple(
            self.models.model_spec(Table(self, f"candidates[{i}]", item, schema.MODEL_KEYS), baseline)
            for i, item in enumerate(candidate_tables)
        )
        self.unique_names({"baseline": baseline, **checks.indexed("candidates", candidates)})
        tasks = tuple(
            self.tasks.task(Table(self, f"tasks[{i}]", item, schema.TASK_KEYS))
            for i, item in enumerate(top.array_of_tables("tasks"))
        )
        self.unique_names(checks.indexed("tasks", tasks))
        device = top.get("device", checks.text(("cuda", "cpu")), "cuda")
        config = GateConfig(
            path=path,
            baseline=baseline,
            candidates=candidates,
            noise=self.measures.noise(top.table("noise", schema.NOISE_KEYS)),
            probabilities=self.measures.probabilities(top.table("probabilities", schema.PROBABILITY_KEYS),
                                                      (baseline, *candidates))
            if "probabilities" in raw
            else None,
            tasks=tasks,
            speed=self.speed(top.table("speed", schema.SPEED_CHECKS)) if "speed" in raw else None,
            device=device,
            deterministic_scheduling=top.get("deterministic_scheduling", checks.boolean, False),
            run_alpha=top.get("run_alpha", checks.number(0, 0.5), RUN_ALPHA),
            decode=self.measures.decode(top.table("decode", schema.DECODE_KEYS)) if "decode" in raw else None,
            load=self.load(top.table("load", schema.LOAD_CHECKS), device) if "load" in raw else None,
            speculative=SpeculativeSpec(**top.table("speculative", schema.SPECULATIVE_CHECKS).values(
                SpeculativeSpec, schema.SPECULATIVE_CHECKS)) if "speculative" in raw else None,
        )
        if config.probabilities is None and not config.tasks and config.speed is None and config.load is None:
            raise self.error("(top level)", "expected at least one check: [probabilities], [[tasks]], [speed] "
                                            "or [load]")
        checks.across_tables(config, self.model_configs, self.error)
        return config

    def unique_names(self, specs: dict[str, ModelSpec | TaskSpec]) -> None:
        """Names become test ids, so two specs of one kind may not share one."""
        seen: dict[str, str] = {}
        for where, spec in specs.items():
            if spec.name in seen:
                raise self.error(f"{where}.name", f"duplicate name {spec.name!r} (also used by {seen[spec.name]})")
            seen[spec.name] = where

    def speed(self, table: Table) -> SpeedSpec:
        values = table.values(SpeedSpec, schema.SPEED_CHECKS)
        if values["gpu"] != "auto":
            entry = gpu_bandwidths.find_gpu(values["gpu"])
            if entry is not None:
                values["gpu"] = entry.name
            elif not values["bandwidth_gbps"]:
                raise self.error(
                    table.key("gpu"),
                    f'unknown GPU {values["gpu"]!r}; expected "auto", '
                    f'one of {", ".join(gpu_bandwidths.known_names())}, '
                    "or any label together with speed.bandwidth_gbps > 0",
                )
        if values["target_rel_se"] and values["min_iters"] > values["iters"]:
            raise self.error(table.key("min_iters"), f"expected at most speed.iters ({values['iters']}), "
                                                     f"got {values['min_iters']}")
        return SpeedSpec(**values)

    def load(self, table: Table, device: str) -> LoadSpec:
        values = table.values(LoadSpec, schema.LOAD_CHECKS)
        if device == "cpu" and "min_throughput_fraction" not in table.raw:
            values["min_throughput_fraction"] = CPU_MIN_THROUGHPUT_FRACTION
        spec = LoadSpec(**values)
        if spec.requests is not None and spec.requests < max(spec.concurrencies):
            raise self.error(table.key("requests"), f"expected at least the highest concurrency, "
                                                    f"{max(spec.concurrencies)}, got {spec.requests}: the level "
                                                    "would never have that many requests in flight")
        return spec
