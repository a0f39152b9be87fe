from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pytest_fp8gate.atomic import atomic_open, atomic_write_bytes, atomic_write_text
from pytest_fp8gate.core.dumps import (
    DumpFormatError,
    read_lm_eval_samples,
    read_logprob_dump,
    read_logprob_metadata,
    write_lm_eval_samples,
    write_logprob_dump,
)
from pytest_fp8gate.core.logprobs import LogprobRun


def full_run(n: int = 6, k: int = 3, vocab: int = 10) -> LogprobRun:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(n, vocab))
    full = (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).astype(np.float32)
    return LogprobRun(
        real_logprob=-np.abs(rng.normal(size=n)),
        top_ids=rng.integers(0, vocab, (n, k)),
        top_logprobs=-np.abs(rng.normal(size=(n, k))),
        full_logprobs=full,
        logprobs_on_base_ids=np.where(rng.random((n, k)) < 0.3, np.nan, -np.abs(rng.normal(size=(n, k)))),
        token_ids=rng.integers(0, vocab, n),
    )


def test_article_json_reads_as_top1_run(tmp_path):
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps([{"real": -0.5, "top": 17}, {"real": -2.25, "top": 3}]))
    run = read_logprob_dump(path)
    assert run.real_logprob.tolist() == [-0.5, -2.25]
    assert run.top_ids.tolist() == [[17], [3]]
    assert np.isnan(run.top_logprobs).all() and run.top_logprobs.shape == (2, 1)
    assert read_logprob_metadata(path) == {}


def test_npz_round_trip_keeps_every_array_and_metadata(tmp_path):
    run = full_run()
    path = tmp_path / "fp8.npz"
    metadata = {"model": "m", "quantization": "fp8_per_channel", "pass": "candidate"}
    write_logprob_dump(path, run, metadata)
    back = read_logprob_dump(path)
    for name in ("real_logprob", "top_ids", "top_logprobs", "logprobs_on_base_ids", "token_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(run, name))
    assert back.full_logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.full_logprobs, run.full_logprobs)
    assert read_logprob_metadata(path) == metadata


def test_npz_without_optional_arrays(tmp_path):
    run = LogprobRun(np.zeros(2), np.ones((2, 1)), np.zeros((2, 1)))
    path = tmp_path / "plain.npz"
    write_logprob_dump(path, run)
    back = read_logprob_dump(path)
    assert back.full_logprobs is None and back.token_ids is None
    assert read_logprob_metadata(path) == {}


def test_format_is_detected_from_content_not_suffix(tmp_path):
    path = tmp_path / "dump.bin"
    write_logprob_dump(path, full_run())
    assert read_logprob_dump(path).positions == 6


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "JSON list"),
        ("[]", "non-empty"),
        ('{"real": 1, "top": 2}', "JSON list"),
        ('[{"real": -1.0, "top": 2}, {"real": -1.0}]', 'row 1 is {"real": -1.0}'),
        ('[{"real": -1.0, "top": "2"}]', "row 0"),
        ('[{"real": null, "top": 2}]', "row 0"),
        ('[{"real": -1.0, "top": 2.5}]', "row 0"),
        ('[{"real": NaN, "top": 2}]', "NaN"),
    ],
)
def test_malformed_article_dump_names_file_and_format(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DumpFormatError, match=expected) as info:
        read_logprob_dump(path)
    assert str(info.value).startswith(f"{path}: ")
    assert info.value.path == str(path)


def test_truncated_npz_is_a_format_error(tmp_path):
    good = tmp_path / "good.npz"
    write_logprob_dump(good, full_run())
    bad = tmp_path / "truncated.npz"
    bad.write_bytes(good.read_bytes()[:100])
    with pytest.raises(DumpFormatError, match="truncated.npz: an fp8gate .npz dump"):
        read_logprob_dump(bad)


def test_npz_missing_or_inconsistent_arrays(tmp_path):
    missing = tmp_path / "missing.npz"
    np.savez(missing, real_logprob=np.zeros(3))
    with pytest.raises(DumpFormatError, match="missing top_ids, top_logprobs"):
        read_logprob_dump(missing)
    ragged = tmp_path / "ragged.npz"
    np.savez(
        ragged, real_logprob=np.zeros(3), top_ids=np.zeros((2, 1)), top_logprobs=np.zeros((2, 1))
    )
    with pytest.raises(DumpFormatError, match="consistent shapes"):
        read_logprob_dump(ragged)


class Boom(RuntimeError):
    pass


def test_atomic_write_leaves_no_partial_file_when_writer_raises(tmp_path):
    path = tmp_path / "out.txt"
    with pytest.raises(Boom):
        with atomic_open(path, "w", encoding="utf-8") as handle:
            handle.write("half of it")
            raise Boom
    assert os.listdir(tmp_path) == []

    atomic_write_text(path, "old")
    with pytest.raises(Boom):
        with atomic_open(path, "wb") as handle:
            handle.write(b"new but incomplete")
            raise Boom
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_atomic_dump_write_keeps_previous_dump_on_failure(tmp_path):
    path = tmp_path / "run.npz"
    write_logprob_dump(path, full_run())
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_logprob_dump(path, full_run(), metadata={"bad": object()})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["run.npz"]


def test_atomic_helpers_write_and_replace(tmp_path):
    path = tmp_path / "blob"
    atomic_write_bytes(path, b"\x00\x01")
    atomic_write_bytes(path, b"\x02")
    assert path.read_bytes() == b"\x02"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would, not mkstemp's 0600
    atomic_write_text(path, "é")
    assert path.read_text(encoding="utf-8") == "é"


SAMPLES = [
    {
        "doc_id": 0,
        "filter": "strict-match",
        "prompt_hash": "p0",
        "target": "Natalia sold 48/2 = 24 clips.\n#### 72",
        "resps": [["... #### 72"]],
        "filtered_resps": ["72"],
        "metrics": ["exact_match"],
        "exact_match": 1.0,
    },
    {
        "doc_id": 1,
        "filter": "strict-match",
        "prompt_hash": "p1",
        "target": "#### 10",
        "resps": [["no answer"]],
        "filtered_resps": ["[invalid]"],
        "metrics": ["exact_match"],
        "exact_match": 0.0,
    },
    {
        "doc_id": 0,
        "filter": "flexible-extract",
        "prompt_hash": "p0",
        "target": "#### 72",
        "resps": [["... 72"]],
        "filtered_resps": ["72"],
        "metrics": ["exact_match"],
        "exact_match": 1.0,
    },
]


def test_lm_eval_samples_keep_one_filter(tmp_path):
    path = tmp_path / "samples_gsm8k.jsonl"
    write_lm_eval_samples(path, SAMPLES)
    records = read_lm_eval_samples(path)
    assert [(r.doc_id, r.filter, r.correct, r.prompt_hash, r.response) for r in records] == [
        (0, "strict-match", True, "p0", "72"),
        (1, "strict-match", False, "p1", "[invalid]"),
    ]
    assert records[0].target.endswith("#### 72")
    flexible = read_lm_eval_samples(path, filter_name="flexible-extract")
    assert [r.doc_id for r in flexible] == [0]


def test_lm_eval_samples_with_acc_metric_and_numpy_scalars(tmp_path):
    path = tmp_path / "samples_arc.jsonl"
    row = {"doc_id": 5, "filter": "none", "metrics": ["acc", "acc_norm"], "target": 2}
    write_lm_eval_samples(path, [{**row, "acc": np.float64(1.0), "acc_norm": np.float64(0.0)}])
    (record,) = read_lm_eval_samples(path, filter_name="none")
    assert record.correct and record.target == "2" and record.prompt_hash is None
    (normed,) = read_lm_eval_samples(path, filter_name="none", metric="acc_norm")
    assert not normed.correct


@pytest.mark.parametrize(
    ("lines", "kwargs", "expected"),
    [
        (["{broken"], {}, "line 1 is not JSON"),
        (['{"doc_id": 0}'], {}, "line 1 lacks doc_id or filter"),
        ([json.dumps(SAMPLES[2])], {}, r"'strict-match' \(filters present: flexible-extract\)"),
        ([json.dumps({**SAMPLES[0], "exact_match": 0.5})], {}, "0/1 score, got 0.5"),
        ([json.dumps(SAMPLES[0])], {"metric": "acc"}, "'acc' to be a 0/1 score, got None"),
        ([json.dumps({**SAMPLES[0], "metrics": []})], {}, "no 'metrics' list"),
    ],
)
def test_malformed_lm_eval_samples(tmp_path, lines, kwargs, expected):
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    with pytest.raises(DumpFormatError, match=expected) as info:
        read_lm_eval_samples(path, **kwargs)
    assert str(info.value).startswith(f"{path}: ")


def test_npz_metadata_that_is_not_a_json_object(tmp_path):
    path = tmp_path / "odd.npz"
    np.savez(path, real_logprob=np.zeros(1), metadata=np.array("[1, 2]"))
    with pytest.raises(DumpFormatError, match="odd.npz: metadata as a JSON object string"):
        read_logprob_metadata(path)


def test_atomic_writes_fsync_the_directory_after_the_rename(tmp_path, monkeypatch):
    import os

    from pytest_fp8gate import atomic

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    atomic.atomic_write_text(tmp_path / "a.txt", "x")
    # The file's data first, then its name: the directory entry is flushed after the rename.
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"]
    assert events[1:] == [("replace", str(tmp_path / "a.txt")), ("fsync", str(tmp_path))]
    events.clear()
    with atomic.atomic_directory(tmp_path / "d") as work:
        (work / "f").write_text("y")
    assert events[-1] == ("fsync", str(tmp_path))
