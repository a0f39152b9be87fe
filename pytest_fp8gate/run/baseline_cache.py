"""A baseline measured once and reused across runs, keyed by everything that changes its numbers.

An entry is a directory ``<baseline name>-<key hash>/`` holding the baseline's
artifacts (logprob dumps, lm-eval samples and results of every pass, engine
facts, provenance), ``record.json`` (what ``Measurements`` restores from them),
``key.json`` and last ``manifest.json`` (size and sha256 of every other file).
It is built in a staging directory and renamed into place, so a reader sees a
whole entry or none; one that fails its manifest or key is named and measured
again, never reused. ``<entry>.lock`` (flock) serialises the runs that want one
key: the second waits for the first's entry instead of measuring it again (or, told
not to wait, measures its own and leaves the entry to the first); a holder that dies
releases it, and the run that waited measures afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..atomic import atomic_open, atomic_write_text, fsync_directory
from ..config.spec import GateConfig, LoadSpec, ModelSpec
from ..core.decode_phase import DecodeRun
from ..core.dumps import read_logprob_dump
from ..core.logprobs import LogprobRun
from ..core.rules import LoadLevel
from ..core.spec_decode import Window
from ..engines import provenance, stack
from ..engines.base import Latency
from ..errors import CacheEntryError
from .record import (
    DECODE_DUMP,
    FLOOR_DUMP,
    PREFILL_DUMP,
    BaselineRecord,
    DecodeResult,
    ModelResult,
    Needs,
    PassResult,
    protocol_path,
)

FORMAT = 1  # bump when the entry layout or the meaning of a stored number changes
MANIFEST = "manifest.json"
RECORD = "record.json"
KEY = "key.json"
# How long a run waits for another that measures the same baseline: longer than any baseline
# measurement takes (an 8B model's tasks on one GPU: well under an hour), short of a CI job's limit.
LOCK_WAIT_S = 2 * 3600.0
LOCK_POLL_S = 0.5


# What of [speed] is measured, not the limit or the bandwidth it is judged against.
SPEED_KEY = ("input_len", "output_len", "batch_size", "warmup_iters", "iters", "min_iters", "target_rel_se")


def baseline_key(config: GateConfig, needs: Needs, engine_settings: dict[str, Any],
                 model: dict[str, Any]) -> dict[str, Any]:
    """Everything that changes the baseline's numbers, as one JSON document."""
    environment = provenance.environment()
    devices = {k: v for k, v in environment["devices"].items() if k != "cuda_visible_devices"}
    probabilities = config.probabilities
    speed = config.speed
    key = {
        "format": FORMAT,
        "model": _portable_model(model),
        # An env table joins the key only when there is one, so that existing entries keep theirs;
        # its values hashed, as they may hold secrets (HF_TOKEN) and the key is written to disk.
        "engine": {"kwargs": config.baseline.engine, **engine_settings,
                   **({"env_sha256": _env_hash(config.baseline.env)} if config.baseline.env else {})},
        "versions": environment["versions"],
        "devices": devices,
        # What picks the kernels and backends (stack.py): another one measures the baseline again.
        "stack": stack.selection_inputs(),
        "noise_passes": list(config.noise.passes),
        "needs": {"probabilities": needs.probabilities, "tasks": sorted(needs.tasks), "speed": needs.speed},
        "probabilities": None if probabilities is None or not needs.probabilities else {
            "corpus": _without(provenance.corpus_fingerprint(probabilities.corpus), "file"),
            "chunks": probabilities.chunks,
            "chunk_tokens": probabilities.chunk_tokens, "top_k": probabilities.top_k,
        },
        "tasks": [_without(provenance.task_fingerprint(t), "include_path") for t in config.tasks
                  if t.name in needs.tasks],
        "speed": {name: getattr(speed, name) for name in SPEED_KEY} if speed is not None and needs.speed else None,
        # Like env: only when measured, so that entries without load keep their keys.
        **({"load": _load_key(config.load)} if config.load is not None and needs.load else {}),
    }
    if probabilities is not None and needs.probabilities and probabilities.measured_references:
        key["references"] = list(probabilities.measured_references)  # as decode: only when measured
    if needs.speculative:  # as decode: only then, so existing entries keep their keys
        key["needs"]["speculative"] = True
    if needs.decode and config.decode is not None:  # joins the key only then, so existing entries keep theirs
        key["needs"]["decode"] = True
        key["decode"] = {name: getattr(config.decode, name) for name in ("prompts", "prompt_tokens", "new_tokens")}
    return key


def _load_key(load: LoadSpec) -> dict[str, Any]:
    """What of [load] is measured (not its limits): the levels, their requests and lengths."""
    return {"concurrencies": list(load.concurrencies), "requests": [load.requests_at(c) for c in load.concurrencies],
            "input_len": load.input_len, "output_len": load.output_len}


# Local files are keyed by their content, not where they are, so that a cache (or a committed
# directory) serves checkouts at other paths.
def _without(fingerprint: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in fingerprint.items() if k != name}


def _env_hash(env: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(env.items())).encode()).hexdigest()


def _portable_model(model: dict[str, Any]) -> dict[str, Any]:
    if model.get("weights_sha256") and Path(model["model"]).is_dir():
        return dict(model, model=f"local checkpoint {Path(model['model']).name}")
    return model


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(provenance.as_json(key).encode()).hexdigest()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for name, item in items:
        flat.update(_flatten(item, f"{prefix}.{name}" if prefix else str(name)))
    return flat


def key_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ, e.g. ``versions.vllm``, ``tasks.0.files_sha256``."""
    a, b = _flatten(json.loads(provenance.as_json(stored))), _flatten(json.loads(provenance.as_json(wanted)))
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))


@dataclasses.dataclass(frozen=True)
class Wait:
    """What taking an entry's lock cost: the seconds waited and the pid that held it (None: it was free)."""

    seconds: float = 0.0
    holder: str | None = None

    def __str__(self) -> str:
        return f"waited {self.seconds:.1f} s for pid {self.holder}, which was measuring this baseline"


def _holder(handle: Any) -> str:
    handle.seek(0)
    return handle.read().strip() or "unknown"


def _acquire(handle: Any, lock: Path, wait_s: float, announce: Callable[[str], None]) -> Wait | None:
    """flock ``handle``, polling until ``wait_s`` has passed, then one error naming the holder's pid; with
    ``wait_s`` 0, None when another run holds it. The holder's death releases it (the kernel drops its flock)."""
    started = time.monotonic()
    holder = None
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return Wait(time.monotonic() - started, holder) if holder is not None else Wait()
        except BlockingIOError:
            pass
        if not wait_s:
            return None
        if holder is None:
            holder = _holder(handle)
            announce(f"fp8gate: waiting for {lock.name} (held by pid {holder}): another run is measuring "
                     f"this baseline; waiting up to {wait_s:g} s")
        if time.monotonic() - started >= wait_s:
            holder = _holder(handle)
            raise CacheEntryError(f"{lock}: still held after {wait_s:g} s by pid {holder}, a run measuring this "
                                  f"baseline; if that process is stuck, stop it (kill {holder}) and run again")
        time.sleep(LOCK_POLL_S)


class BaselineCache:
    """``--fp8gate-baseline-cache DIR``: restores or measures and stores the baseline."""

    def __init__(self, root: Path, update: bool, announce: Callable[[str], None],
                 lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.root = root
        self.update = update
        self.announce = announce
        self.lock_wait_s = lock_wait_s

    def entry_path(self, name: str, key: dict[str, Any]) -> Path:
        return self.root / f"{name}-{key_digest(key)[:16]}"

    def fetch(self, spec: ModelSpec, key: dict[str, Any], target: Path, measure: Callable[[], BaselineRecord],
              stale: Callable[[BaselineRecord], str | None] | None = None) -> BaselineRecord:
        """The cached baseline ``spec`` when a valid entry has ``key`` (see ``baseline_key``), its files
        copied into ``target``; else ``measure()``, which writes its artifacts there, then store it.
        ``stale``: why a restored record no longer holds for what it was measured on (an endpoint that
        answers otherwise now), or None; a reason measures it again and replaces the entry."""
        name = spec.name
        entry = self.entry_path(name, key)
        with self.locked(entry) as wait:
            if wait is None:  # another run measures this entry, and this one was told not to wait for it
                self.announce(f"fp8gate: {entry.name}.lock is held by another run measuring this baseline; "
                              "--fp8gate-cache-wait 0: measuring this run's own, which that run stores")
                record = measure()
                record.origin = "measured in this session, not stored: another run was measuring it into the cache"
                return record
            waited = f"; {wait}" if wait.holder else ""
            if wait.holder:
                self.announce(f"fp8gate: {wait} ({entry.name}.lock)")
            if self.update:
                why = "--fp8gate-update-baseline"
            else:
                try:
                    record = self.load(entry, key, spec, target)
                    changed = stale(record) if stale is not None else None
                    if changed is None:
                        self.announce(f"fp8gate: baseline {name} from the cache: {entry} "
                                      f"(measured {record.measured_at}); no baseline engine started")
                        record.origin += waited
                        return record
                    why = f"entry not reused: {changed}"
                except FileNotFoundError:
                    why = self._miss_reason(name, key)
                    if wait.holder:  # killed or failed mid-measurement: its staging is removed when this stores
                        why += f"; pid {wait.holder} ended without storing it"
                except CacheEntryError as err:
                    why = f"entry not reused: {err}"
            self.announce(f"fp8gate: baseline cache miss for {name} ({why}); measuring")
            record = measure()
            try:
                self.store(entry, key, record, target)
            except OSError as err:  # a full or read-only cache costs the next run time, not this run's verdicts
                self.announce(f"fp8gate: the baseline was not stored in the cache: {err}")
                record.origin = f"measured in this session; storing it in the baseline cache failed: {err}"
                return record
            record.origin = f"measured in this session and stored in the baseline cache: {entry} ({why}{waited})"
            return record

    @contextlib.contextmanager
    def locked(self, entry: Path) -> Iterator[Wait | None]:
        """Hold ``<entry>.lock``; wait at most ``lock_wait_s`` for a run that holds it (its pid is in the file).
        Yields what the wait cost, or None, holding nothing, where ``lock_wait_s`` is 0 and another run holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock = entry.with_name(entry.name + ".lock")
        with open(lock, "a+") as handle:
            wait = _acquire(handle, lock, self.lock_wait_s, self.announce)
            if wait is None:
                yield None
                return
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n")  # for a run that waits: who holds it
            handle.flush()
            try:
                yield wait
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _miss_reason(self, name: str, key: dict[str, Any]) -> str:
        """Why there is no entry: which key fields the newest entry of this baseline differs in."""
        others = sorted(self.root.glob(f"{name}-*/{KEY}"), key=lambda p: p.stat().st_mtime)
        for path in reversed(others):
            try:
                stored = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            changed = key_differences(stored, key)
            shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
            return f"no entry for this key; the newest entry, {path.parent.name}, differs in {shown}"
        return "no entry for this key"

    # ---- reading -------------------------------------------------------------

    def load(self, entry: Path, key: dict[str, Any], spec: ModelSpec, target: Path) -> BaselineRecord:
        """Check the entry against its manifest and the key, copy it into ``target``, restore it.

        Raises FileNotFoundError when there is no entry and CacheEntryError when it is unusable.
        """
        if not entry.is_dir():
            raise FileNotFoundError(entry)
        listed = verify(entry, key)
        try:
            stored = json.loads((entry / RECORD).read_text(encoding="utf-8"))
            unlisted = [name for name in stored["files"] if name not in listed]
        except (ValueError, KeyError, TypeError) as err:
            raise CacheEntryError(f"{entry / RECORD}: unreadable ({err})") from None
        if unlisted:
            raise CacheEntryError(f"{entry / RECORD}: names files the manifest lacks: {', '.join(unlisted)}")
        for relative in stored["files"]:
            _copy_atomic(entry / relative, target / relative)
        try:
            return _restore(stored, target, spec, entry, key)
        except (KeyError, TypeError) as err:
            raise CacheEntryError(f"{entry / RECORD}: lacks {err}") from None

    # ---- writing -------------------------------------------------------------

    def store(self, entry: Path, key: dict[str, Any], record: BaselineRecord, source: Path) -> None:
        """Write the entry in a staging directory, then rename it into place (call under the lock)."""
        for stale in self.root.glob(f".*-{entry.name}-*"):  # left by a run that died mid-write
            shutil.rmtree(stale, ignore_errors=True)
        staging = self.root / f".staging-{entry.name}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            stored = _serialise(record, source)
            for relative in stored["files"]:
                _copy_atomic(source / relative, staging / relative)
            atomic_write_text(staging / RECORD, json.dumps(stored, indent=1, default=str))
            atomic_write_text(staging / KEY, json.dumps(key, indent=1, sort_keys=True, default=str))
            files = {path.relative_to(staging).as_posix(): _file_entry(path)
                     for path in sorted(staging.rglob("*")) if path.is_file()}
            atomic_write_text(staging / MANIFEST, json.dumps({"format": FORMAT, "key_sha256": key_digest(key),
                                                              "files": files}, indent=1))
            _replace_dir(staging, entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def verify(entry: Path, key: dict[str, Any]) -> set[str]:
    """The entry's files; CacheEntryError names the first one missing, truncated, altered or unlisted."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CacheEntryError(f"{entry / MANIFEST}: missing or unreadable ({err})") from None
    if manifest.get("format") != FORMAT:
        raise CacheEntryError(f"{entry / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT}")
    if manifest.get("key_sha256") != key_digest(key):
        raise CacheEntryError(f"{entry / MANIFEST}: key mismatch (the entry was stored for another key)")
    for relative, expected in files.items():
        path = entry / relative
        if not path.is_file():
            raise CacheEntryError(f"{path}: missing")
        if path.stat().st_size != expected["size"]:
            raise CacheEntryError(f"{path}: {path.stat().st_size} bytes, the manifest says {expected['size']} "
                                  "(truncated or rewritten)")
        if provenance.file_sha256(path) != expected["sha256"]:
            raise CacheEntryError(f"{path}: sha256 differs from the manifest (corrupt)")
    present = {p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file()} - {MANIFEST}
    if present != set(files):
        raise CacheEntryError(f"{entry}: files not in the manifest: {', '.join(sorted(present - set(files)))}")
    for required in (RECORD, KEY):
        if required not in files:
            raise CacheEntryError(f"{entry / required}: missing")
    differences = key_differences(json.loads((entry / KEY).read_text(encoding="utf-8")), key)
    if differences:
        raise CacheEntryError(f"{entry / KEY}: key mismatch in {', '.join(differences)}")
    return set(files)


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": provenance.file_sha256(path)}


def _copy_atomic(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as reader, atomic_open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, 1 << 20)


def _replace_dir(staging: Path, entry: Path) -> None:
    """Rename ``staging`` to ``entry``; an old entry is moved aside first, then removed."""
    trash = None
    if entry.exists():
        trash = entry.with_name(f".trash-{entry.name}-{uuid.uuid4().hex[:8]}")
        os.rename(entry, trash)
    os.rename(staging, entry)
    fsync_directory(entry.parent)  # the rename itself survives a crash
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


# ---- record <-> JSON ---------------------------------------------------------


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
# (made again for this checkout, measure._look_up_speed_inputs) and served_otherwise.
_FIELDS = (
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


def _serialise(record: BaselineRecord, root: Path) -> dict[str, Any]:
    stored = {field.key: field.write(_value(record, field.attribute), root) for field in _FIELDS
              if field.write is not None}
    return {**stored, "files": _files(record, root)}


def _restore(stored: dict[str, Any], root: Path, spec: ModelSpec, entry: Path, key: dict[str, Any]
             ) -> BaselineRecord:
    source = _Entry(root, entry, key)
    values: dict[str, dict[str, Any]] = {"result": {}, "": {}}
    for field in _FIELDS:
        owner, _, name = field.attribute.rpartition(".")
        values[owner][name] = field.read(stored.get(field.key) if field.optional else stored[field.key], source)
    record = BaselineRecord(ModelResult(spec, **values["result"]), **values[""], cached=True)
    record.origin = f"from the baseline cache: {entry} (measured {record.measured_at}; no baseline engine started)"
    return record
