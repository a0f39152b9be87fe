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
releases it, and the run that waited measures afresh. The key is ``cache_key.py``'s; what
``record.json`` holds, ``cache_record.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..atomic import atomic_open, atomic_write_text, fsync_directory
from ..config.spec import ModelSpec
from ..engines import provenance
from ..errors import CacheEntryError
from .cache_key import FORMAT, key_differences, key_digest
from .cache_record import RECORD, restore, serialise
from .record import BaselineRecord

MANIFEST = "manifest.json"
KEY = "key.json"
# How long a run waits for another that measures the same baseline: longer than any baseline
# measurement takes (an 8B model's tasks on one GPU: well under an hour), short of a CI job's limit.
LOCK_WAIT_S = 2 * 3600.0
LOCK_POLL_S = 0.5


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
            return restore(stored, target, spec, entry, key)
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
            stored = serialise(record, source)
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
