from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fakes import TASK, fake_baseline, make_measurements, write_recorded_gate
from pytest_fp8gate.engines import provenance
from pytest_fp8gate.run.baseline_cache import BaselineCache, CacheEntryError, verify
from pytest_fp8gate.run.cache_key import baseline_key
from pytest_fp8gate.run.record import Needs

NEEDS = Needs(probabilities=True, tasks=frozenset([TASK]))


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    return write_recorded_gate(tmp_path / "gate")


@pytest.fixture
def lines() -> list[str]:
    return []


def fetch(gate: Path, cache_dir: Path, artifacts: Path, lines: list[str], update: bool = False):
    """Fetch the baseline through the cache; returns (record, whether it was measured)."""
    cache = BaselineCache(cache_dir, update, lines.append)
    measurements = make_measurements(gate, artifacts, cache)
    calls: list[int] = []
    spec = measurements.config.baseline
    record = cache.fetch(spec, measurements.baseline_key(NEEDS), artifacts / spec.name,
                         fake_baseline(measurements, calls))
    return record, bool(calls)


def only_entry(cache_dir: Path) -> Path:
    (entry,) = [p for p in cache_dir.iterdir() if p.is_dir()]
    return entry


def test_cold_then_warm_restores_every_pass_without_measuring(gate: Path, tmp_path: Path, lines: list[str]):
    cold, measured = fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    assert measured and not cold.cached
    assert "stored in the baseline cache" in cold.origin
    warm, measured = fetch(gate, tmp_path / "cache", tmp_path / "run2", lines)
    assert not measured and warm.cached
    assert "measured 2026-12-01T09:00:00+00:00" in warm.origin and "no baseline engine started" in warm.origin
    assert set(warm.result.noise) == {"batch-order", "fp16"}
    np.testing.assert_array_equal(warm.result.main.logprobs.full_logprobs, cold.result.main.logprobs.full_logprobs)
    # The reference builds' passes are kept with the baseline: measured once per baseline.
    np.testing.assert_array_equal(warm.result.references["q8_0"].logprobs.full_logprobs,
                                  cold.result.references["q8_0"].logprobs.full_logprobs)
    # Restored into this run's artifacts, so the report's recompute commands work there.
    assert warm.result.main.samples[TASK] == tmp_path / "run2" / "bf16" / "main" / f"samples_{TASK}.jsonl"
    assert warm.result.noise["fp16"].samples[TASK].read_bytes() == cold.result.noise["fp16"].samples[TASK].read_bytes()
    assert (tmp_path / "run2" / "bf16" / "fp16" / f"results_{TASK}.json").is_file()
    assert warm.chunks == [[1, 2, 3]] and warm.result.kv_cache_tokens == 4096
    assert warm.engine_runs[0]["duration_s"] == 12.5


def test_update_baseline_measures_again(gate: Path, tmp_path: Path, lines: list[str]):
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    _, measured = fetch(gate, tmp_path / "cache", tmp_path / "run2", lines, update=True)
    assert measured
    assert "--fp8gate-update-baseline" in lines[-1]


def _edit_corpus(gate: Path) -> None:
    corpus = gate.parent / "corpus.txt"
    corpus.write_text(corpus.read_text() + "eleven\n")


def _edit_task_file(gate: Path) -> None:
    (gate.parent / "tasks" / "tiny.yaml").write_text("task: tiny_task\ndataset_path: json\nnum_fewshot: 3\n")


def _edit_engine(gate: Path) -> None:
    gate.write_text(gate.read_text().replace("max_model_len = 2048", "max_model_len = 1024"))


def _edit_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    env = provenance.environment()
    changed = dict(env, versions=dict(env["versions"], vllm="0.99.0 (vllm)"))
    monkeypatch.setattr(provenance, "environment", lambda: changed)


@pytest.mark.parametrize(("change", "named"), [
    (_edit_corpus, "probabilities.corpus.sha256"),
    (_edit_task_file, "tasks.0.files_sha256"),
    (_edit_engine, "engine.kwargs.max_model_len"),
    ("vllm", "versions.vllm"),
])
def test_a_change_that_moves_the_numbers_invalidates_the_entry(
        gate: Path, tmp_path: Path, lines: list[str], monkeypatch: pytest.MonkeyPatch, change, named: str):
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    if change == "vllm":
        _edit_vllm_version(monkeypatch)
    else:
        change(gate)
    _, measured = fetch(gate, tmp_path / "cache", tmp_path / "run2", lines)
    assert measured
    assert "baseline cache miss" in lines[-1] and named in lines[-1]


def test_the_key_names_the_needs(gate: Path, tmp_path: Path):
    # An entry measured for fewer rules than asked is a different key.
    measurements = make_measurements(gate, tmp_path / "a")
    settings, model = measurements.engine_settings(), measurements.fingerprint(measurements.config.baseline)
    fewer = baseline_key(measurements.config, Needs(tasks=frozenset([TASK])), settings, model)
    assert fewer != baseline_key(measurements.config, NEEDS, settings, model)
    assert fewer["probabilities"] is None and fewer["needs"]["probabilities"] is False


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "delete the manifest", "add a file"])
def test_a_damaged_entry_is_named_and_measured_again(
        gate: Path, tmp_path: Path, lines: list[str], damage: str):
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    entry = only_entry(tmp_path / "cache")
    samples = entry / "main" / f"samples_{TASK}.jsonl"
    if damage == "truncate":
        samples.write_bytes(samples.read_bytes()[:100])
    elif damage == "flip a byte":
        data = bytearray(samples.read_bytes())
        data[10] ^= 1
        samples.write_bytes(bytes(data))
    elif damage == "delete the manifest":
        (entry / "manifest.json").unlink()
    else:
        (entry / "stray.txt").write_text("x")
    _, measured = fetch(gate, tmp_path / "cache", tmp_path / "run2", lines)
    assert measured
    expected = {"truncate": f"{samples}: 100 bytes", "flip a byte": f"{samples}: sha256 differs",
                "delete the manifest": "manifest.json: missing", "add a file": "stray.txt"}[damage]
    assert "entry not reused" in lines[-1] and expected in lines[-1]
    verify(only_entry(tmp_path / "cache"), json.loads((entry / "key.json").read_text()))  # rewritten whole


def test_a_key_mismatch_is_detected(gate: Path, tmp_path: Path, lines: list[str]):
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    entry = only_entry(tmp_path / "cache")
    key = json.loads((entry / "key.json").read_text())
    wrong = dict(key, noise_passes=["fp16"])
    (entry / "key.json").write_text(json.dumps(wrong))
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["files"]["key.json"] = {"size": (entry / "key.json").stat().st_size,
                                     "sha256": provenance.file_sha256(entry / "key.json")}
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheEntryError, match=r"key.json: key mismatch in noise_passes\.0, noise_passes\.1"):
        verify(entry, key)


def test_two_concurrent_runs_leave_one_valid_entry(gate: Path, tmp_path: Path):
    script = Path(__file__).with_name("fakes.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), str(script.parent)]))
    runs = [subprocess.Popen([sys.executable, str(script), str(gate), str(tmp_path / "cache"),
                              str(tmp_path / f"run{i}"), str(tmp_path / f"out{i}.json")], env=env)
            for i in range(2)]
    assert [run.wait(timeout=120) for run in runs] == [0, 0]
    outcomes = sorted(json.loads((tmp_path / f"out{i}.json").read_text())["measured"] for i in range(2))
    assert outcomes == [False, True]  # the second waited for the lock, then found the first's entry
    entry = only_entry(tmp_path / "cache")
    verify(entry, json.loads((entry / "key.json").read_text()))
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith((".staging", ".trash"))]


def test_update_baseline_without_a_cache_is_a_usage_error(pytester: pytest.Pytester):
    result = pytester.runpytest("--fp8gate-update-baseline")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--fp8gate-update-baseline needs a cache: --fp8gate-baseline-cache DIR*"])


def test_cache_and_report_options_from_the_ini_file(pytester: pytest.Pytester):
    pytester.makeini("[pytest]\nfp8gate_baseline_cache = ci/cache\nfp8gate_report = out/gate.md\n")
    pytester.makepyfile("""
        from pytest_fp8gate.face.session import run_state

        def test_settings(pytestconfig):
            settings = run_state(pytestconfig).settings
            assert settings.baseline_cache == pytestconfig.rootpath / "ci" / "cache"
            assert settings.report == pytestconfig.rootpath / "out" / "gate.md"
            assert not settings.update_baseline
    """)
    pytester.runpytest().assert_outcomes(passed=1)


def test_a_failed_store_keeps_this_runs_baseline(gate: Path, tmp_path: Path, lines: list[str],
                                                monkeypatch: pytest.MonkeyPatch):
    def full_disk(*args) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(BaselineCache, "store", full_disk)
    record, measured = fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    assert measured and "storing it in the baseline cache failed" in record.origin
    assert "not stored in the cache: [Errno 28] No space left on device" in lines[-1]


def test_speed_limits_are_not_part_of_the_key(gate: Path, tmp_path: Path):
    gate.write_text(gate.read_text() + "\n[speed]\nmin_fraction_of_ceiling = 0.8\nbandwidth_gbps = 100\n")
    measurements = make_measurements(gate, tmp_path / "a")
    settings, model = measurements.engine_settings(), measurements.fingerprint(measurements.config.baseline)
    key = baseline_key(measurements.config, Needs(speed=True), settings, model)
    gate.write_text(gate.read_text().replace("min_fraction_of_ceiling = 0.8", "min_fraction_of_ceiling = 0.5"))
    again = make_measurements(gate, tmp_path / "a")
    assert baseline_key(again.config, Needs(speed=True), settings, model) == key
    assert key["speed"] == {"input_len": 1000, "output_len": 256, "batch_size": 1, "warmup_iters": 3, "iters": 10,
                            "min_iters": 3, "target_rel_se": 0.01}


def test_a_checkout_at_another_path_reuses_the_entry(gate: Path, tmp_path: Path, lines: list[str]):
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    moved = tmp_path / "elsewhere"
    gate.parent.rename(moved)
    _, measured = fetch(moved / "thresholds.toml", tmp_path / "cache", tmp_path / "run2", lines)
    assert not measured


@pytest.fixture
def uncached_environment():
    """provenance's per-process caches emptied before and after (a faked device must not leak)."""
    def clear() -> None:
        provenance.devices.cache_clear()
        provenance.environment.cache_clear()

    clear()
    yield clear
    clear()


def test_the_key_names_the_visible_gpus(gate: Path, tmp_path: Path, fake_gpus, monkeypatch: pytest.MonkeyPatch,
                                        uncached_environment):
    measurements = make_measurements(gate, tmp_path / "a")
    settings, model = measurements.engine_settings(), measurements.fingerprint(measurements.config.baseline)
    monkeypatch.setattr(provenance, "_driver", lambda: "580.65")
    keys = []
    for names in (("NVIDIA H100 80GB HBM3",), ("NVIDIA H100 80GB HBM3",) * 2, ("NVIDIA L40S",)):
        fake_gpus(*names)
        uncached_environment()
        keys.append(baseline_key(measurements.config, NEEDS, settings, model))
    assert keys[0]["devices"] == {"kind": "cuda", "gpus": ["NVIDIA H100 80GB HBM3"], "driver": "580.65"}
    assert len({json.dumps(key, sort_keys=True) for key in keys}) == 3  # the count and the name both count


def test_a_lock_held_by_a_stuck_process_times_out_naming_it(tmp_path: Path):
    from pytest_fp8gate.run.baseline_cache import BaselineCache

    cache = BaselineCache(tmp_path / "cache", update=False, announce=lambda line: None, lock_wait_s=1.0)
    entry = tmp_path / "cache" / "bf16-0123456789abcdef"
    (tmp_path / "cache").mkdir()
    # A run that took the lock the way BaselineCache does, then hung.
    holder_code = ("import fcntl, os, sys, time\n"
                   "handle = open(sys.argv[1], 'a+'); fcntl.flock(handle, fcntl.LOCK_EX)\n"
                   "handle.truncate(0); handle.write(f'{os.getpid()}\\n'); handle.flush()\n"
                   "print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(entry) + ".lock"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(CacheEntryError) as info:
            with cache.locked(entry):
                pytest.fail("took a lock another process holds")
        assert str(info.value) == (f"{entry}.lock: still held after 1 s by pid {holder.pid}, a run measuring this "
                                   f"baseline; if that process is stuck, stop it (kill {holder.pid}) and run again")
    finally:
        holder.kill()
        holder.wait()
    with cache.locked(entry):  # free again once the holder is gone
        assert (tmp_path / "cache" / (entry.name + ".lock")).read_text() == f"{os.getpid()}\n"


@pytest.mark.parametrize("args, env, expected", [
    (["--fp8gate-baseline-cache", "ci/cache"], None, "ci/cache/vllm-cache"),  # kept with the baseline cache
    (["--fp8gate-baseline-cache", "ci/cache", "--fp8gate-compile-cache", "cc"], None, "cc"),
    (["--fp8gate-baseline-cache", "ci/cache"], "/elsewhere", None),  # the environment's own root stands
    (["--fp8gate-compile-cache", "cc"], "/elsewhere", "cc"),  # asked for by name: over the environment
    (["--fp8gate-report", "r.md"], None, None),  # no baseline cache: vLLM's own default
])
def test_the_compile_cache_defaults_to_a_folder_in_the_baseline_cache(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], env: str | None,
        expected: str | None):
    if env is None:
        monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    else:
        monkeypatch.setenv("VLLM_CACHE_ROOT", env)
    pytester.makepyfile(f"""
        from pytest_fp8gate.face.session import run_state

        def test_settings(pytestconfig):
            found = run_state(pytestconfig).settings.compile_cache
            expected = {expected!r}
            assert found == (None if expected is None else pytestconfig.rootpath / expected)
    """)
    pytester.runpytest(*args).assert_outcomes(passed=1)


# Record fields that record.json does not hold: the spec and the cache's own marks come from the fetch,
# the speed look-ups are made again for the checkout that restores the entry.
NOT_STORED = {"result", "origin", "cached", "result.spec", "result.memory_bandwidth", "result.weights",
              "result.bandwidth_warning", "result.served_otherwise"}


def test_every_record_field_has_a_row_in_the_cache_s_field_table_or_is_named_as_not_stored():
    from dataclasses import fields

    from pytest_fp8gate.run.cache_record import FIELDS
    from pytest_fp8gate.run.record import BaselineRecord, ModelResult

    record = {f.name for f in fields(BaselineRecord)} | {f"result.{f.name}" for f in fields(ModelResult)}
    stored = [field.attribute for field in FIELDS]
    assert len(stored) == len(set(stored))
    assert set(stored) == record - NOT_STORED
