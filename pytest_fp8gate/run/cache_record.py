"""What a baseline cache entry's ``record.json`` holds of a ``BaselineRecord``: one row per field (``FIELDS``),
how it is written (``serialise``, paths relative to the artifacts root) and read back (``restore``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.spec import ModelSpec
from ..core.decode_phase import DecodeRun
from ..core.dumps import read_logprob_dump
from ..core.logprobs import LogprobRun
from ..core.rules import LoadLevel
from ..core.spec_decode import Window
from ..engines.base import Latency
from ..errors import CacheEntryError
from .record import (
    DECODE_DUMP,
    FLOOR_DUMP,
    PREFILL_DUMP,
    BaselineRecord,
    DecodeResult,
    ModelResult,
    PassResult,
    protocol_path,
)

RECORD = "record.json"

@dataclasses.dataclass(frozen=True)
class _Entry:
    """What a stored field is read back with: the root its files were copied to, the entry, its key."""

    root: Path
    path: Path
    key: dict[str, Any]


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _as_stored(value: Any, root: Path) -> Any:
    return value


def _as_read(stored: Any, entry: _Entry) -> Any:
    return stored


def _write_pass(result: PassResult, root: Path) -> dict[str, Any]:
    return {"label": result.label,
            "logprobs": _relative(result.logprobs_path, root) if result.logprobs_path else None,
            "samples": {task: _relative(path, root) for task, path in result.samples.items()}}


def _read_pass(stored: dict[str, Any], entry: _Entry) -> PassResult:
    logprobs_path = entry.root / stored["logprobs"] if stored["logprobs"] else None
    return PassResult(stored["label"], logprobs=read_logprob_dump(logprobs_path) if logprobs_path else None,
                      logprobs_path=logprobs_path,
                      samples={task: entry.root / relative for task, relative in stored["samples"].items()})


def _write_passes(passes: dict[str, PassResult], root: Path) -> dict[str, Any]:
    return {label: _write_pass(result, root) for label, result in passes.items()}


def _read_passes(stored: dict[str, Any] | None, entry: _Entry) -> dict[str, PassResult]:
    """Passes by label; None (an entry stored before references were kept) holds none."""
    return {label: _read_pass(result, entry) for label, result in (stored or {}).items()}


def _write_latency(latency: Latency | None, root: Path) -> dict[str, Any] | None:
    return latency.as_dict() if latency else None


def _read_latency(stored: dict[str, Any] | None, entry: _Entry) -> Latency | None:
    if stored is None:
        return None
    names = {f.name for f in dataclasses.fields(Latency)}
    return Latency(**{k: v for k, v in stored.items() if k in names})


def _write_levels(levels: list[LoadLevel] | None, root: Path) -> list[dict[str, Any]] | None:
    return [dataclasses.asdict(level) for level in levels] if levels is not None else None


def _read_levels(stored: list[dict[str, Any]] | None, entry: _Entry) -> list[LoadLevel] | None:
    if "load" not in entry.key:
        return None
    if not stored:  # a baseline judged under load is never reused without its levels
        raise CacheEntryError(f"{entry.path / RECORD}: has no load levels, which [load] needs")
    return [LoadLevel(**{**level, "ttft_s": tuple(level["ttft_s"]), "tpot_s": tuple(level["tpot_s"])})
            for level in stored]


def _write_windows(windows: list[Window] | None, root: Path) -> list[dict[str, Any]] | None:
    return [w.as_dict() for w in windows] if windows is not None else None


def _read_windows(stored: list[dict[str, Any]] | None, entry: _Entry) -> list[Window] | None:
    if not entry.key["needs"].get("speculative"):
        return None
    if not stored:  # the acceptance rule judges a cached baseline by its stored counters
        raise CacheEntryError(f"{entry.path / RECORD}: has no speculative-decoding counters, which [speculative] needs")
    return [Window.from_dict(w) for w in stored]


def _floor_labels(decode: DecodeResult) -> list[str]:
    return sorted(name.removeprefix(f"{FLOOR_DUMP}-") for name in decode.dumps if name.startswith(f"{FLOOR_DUMP}-"))


def _write_decode(decode: DecodeResult | None, root: Path) -> dict[str, Any] | None:
    """The baseline's continuations (ids) and where their dumps are, its floors' among them: enough to judge
    without decoding again."""
    if decode is None:
        return None
    floor = _floor_labels(decode)
    if not {DECODE_DUMP, PREFILL_DUMP} <= decode.dumps.keys() or len(decode.dumps) != 2 + len(floor):
        raise OSError(f"the baseline's decode dumps are incomplete ({', '.join(sorted(decode.dumps))})")
    return {"prompts": [list(p) for p in decode.own.prompts], "generated": [list(g) for g in decode.own.generated],
            "dumps": {name: _relative(path, root) for name, path in decode.dumps.items()}, "floor": floor}


def _decode_dumps(stored: dict[str, Any], entry: _Entry) -> dict[str, Path]:
    return {name: entry.root / relative for name, relative in stored["dumps"].items()}


def _read_decode(stored: dict[str, Any] | None, entry: _Entry) -> DecodeResult | None:
    if stored is None:
        return None
    dumps = _decode_dumps(stored, entry)
    own = DecodeRun(tuple(tuple(p) for p in stored["prompts"]), tuple(tuple(g) for g in stored["generated"]),
                    read_logprob_dump(dumps[DECODE_DUMP]))
    return DecodeResult(own, read_logprob_dump(dumps[PREFILL_DUMP]), dumps=dumps)


def _read_decode_floor(stored: dict[str, Any] | None, entry: _Entry) -> dict[str, LogprobRun]:
    if stored is None:
        return {}
    dumps = _decode_dumps(stored, entry)
    return {label: read_logprob_dump(dumps[f"{FLOOR_DUMP}-{label}"]) for label in stored["floor"]}


@dataclasses.dataclass(frozen=True)
class _Field:
    """One field of the record in record.json: the attribute it holds (``result.`` for the baseline's
    ModelResult), its key there, how it is written (value, artifacts root -> JSON) and read back
    (JSON, entry -> value). ``write`` None: written by the field of the same key; ``optional``: entries stored
    before the field existed lack its key."""

    attribute: str
    key: str
    write: Callable[[Any, Path], Any] | None = _as_stored
    read: Callable[[Any, _Entry], Any] = _as_read
    optional: bool = False


# What record.json holds of a BaselineRecord, in the file's order. Not stored: ModelResult's speed look-ups
# (made again for this checkout, steps.Steps.look_up_speed_inputs) and served_otherwise.
FIELDS = (
    _Field("result.main", "main", _write_pass, _read_pass),
    _Field("result.noise", "noise", _write_passes, _read_passes),
    _Field("result.references", "references", _write_passes, _read_passes, optional=True),
    _Field("result.start_s", "start_s"),
    _Field("result.kv_cache_tokens", "kv_cache_tokens"),
    _Field("result.vocab_size", "vocab_size"),
    _Field("result.latency", "latency", _write_latency, _read_latency),
    _Field("result.load", "load", _write_levels, _read_levels, optional=True),
    _Field("result.spec_decode", "spec_decode", _write_windows, _read_windows, optional=True),
    _Field("chunks", "chunks"),
    _Field("id_scoring_refusal", "id_scoring_refusal"),
    _Field("engine_runs", "engine_runs"),
    _Field("result.decode", "decode", _write_decode, _read_decode, optional=True),
    # The floors' dumps are the decode phase's floor-<label> files, listed under decode.floor.
    _Field("decode_floor", "decode", None, _read_decode_floor, optional=True),
)


def _value(record: BaselineRecord, attribute: str) -> Any:
    owner, _, name = attribute.rpartition(".")
    return getattr(record.result if owner else record, name)


def _pass_files(result: PassResult, root: Path) -> list[str]:
    files = [_relative(result.logprobs_path, root)] if result.logprobs_path else []
    for task, path in result.samples.items():
        files.append(_relative(path, root))
        for kept in (path.with_name(f"results_{task}.json"), protocol_path(path)):
            if kept.is_file():
                files.append(_relative(kept, root))
    return files


def _files(record: BaselineRecord, root: Path) -> list[str]:
    """The artifacts the entry keeps beside record.json, relative to ``root``."""
    result = record.result
    files = [*_pass_files(result.main, root)]
    for noise in (*result.noise.values(), *result.references.values()):
        files += _pass_files(noise, root)
    files += [name for name in ("engine.json", "provenance.json") if (root / name).is_file()]
    return files + [_relative(path, root) for path in (result.decode.dumps.values() if result.decode else ())]


def serialise(record: BaselineRecord, root: Path) -> dict[str, Any]:
    stored = {field.key: field.write(_value(record, field.attribute), root) for field in FIELDS
              if field.write is not None}
    return {**stored, "files": _files(record, root)}


def restore(stored: dict[str, Any], root: Path, spec: ModelSpec, entry: Path, key: dict[str, Any]
             ) -> BaselineRecord:
    source = _Entry(root, entry, key)
    values: dict[str, dict[str, Any]] = {"result": {}, "": {}}
    for field in FIELDS:
        owner, _, name = field.attribute.rpartition(".")
        values[owner][name] = field.read(stored.get(field.key) if field.optional else stored[field.key], source)
    record = BaselineRecord(ModelResult(spec, **values["result"]), **values[""], cached=True)
    record.origin = f"from the baseline cache: {entry} (measured {record.measured_at}; no baseline engine started)"
    return record
