"""Read and write the files the gate compares.

Log-prob dumps come in two formats:

* the article's JSON: a list of ``{"real": logprob of the real next token,
  "top": id of the top-1 token}``, one object per scored position;
* fp8gate's ``.npz``: arrays ``real_logprob``, ``top_ids``, ``top_logprobs`` and
  optionally ``full_logprobs``, ``logprobs_on_base_ids``, ``token_ids``, plus a
  JSON ``metadata`` string (model, quantization, pass name, ...).

Answers come from lm-eval's ``--log_samples`` JSONL, one row per (doc, filter).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ..atomic import atomic_open
from ..errors import DumpFormatError
from .answers import AnswerRecord
from .logprobs import LogprobRun

__all__ = [
    "RUN_ID",
    "SAMPLES_RUN_ID",
    "DumpFormatError",
    "read_lm_eval_generations",
    "read_finish_reasons",
    "read_thinking_chars",
    "dump_run_id",
    "read_lm_eval_samples",
    "read_logprob_dump",
    "read_logprob_metadata",
    "samples_run_id",
    "write_lm_eval_samples",
    "write_logprob_dump",
]

PathLike = str | os.PathLike[str]

_REQUIRED_ARRAYS = ("real_logprob", "top_ids", "top_logprobs")
_OPTIONAL_ARRAYS = ("full_logprobs", "logprobs_on_base_ids", "token_ids")
_ZIP_MAGIC = b"PK\x03\x04"
_ARTICLE_FORMAT = 'a JSON list of {"real": <float>, "top": <int>} objects'
_NPZ_FORMAT = f"an fp8gate .npz dump with arrays {', '.join(_REQUIRED_ARRAYS)}"
_SAMPLES_FORMAT = "lm-eval --log_samples JSONL rows"
# Every artifact of one gate run carries its run id (a dump's metadata key, a sample row's
# field), so that files of two runs mixed in one artifacts directory are never paired.
RUN_ID = "run_id"
SAMPLES_RUN_ID = "fp8gate_run_id"
# Why each generated answer ended (vLLM's finish_reason), the gate's field in a sample row.
FINISH_REASON = "finish_reason"
CUT_BY_LENGTH = "length"  # the finish_reason of an answer that max_tokens ended
# A reasoning model's thinking before the answer, in characters up to and including the task's think_end
# marker (None: the text has no marker), the gate's field in a sample row of a task that sets think_end.
THINKING_CHARS = "thinking_chars"


def write_logprob_dump(
    path: PathLike, run: LogprobRun, metadata: Mapping[str, Any] | None = None
) -> None:
    """Write ``run`` as an fp8gate ``.npz`` dump, atomically."""
    arrays = {name: getattr(run, name) for name in _REQUIRED_ARRAYS + _OPTIONAL_ARRAYS}
    arrays = {name: array for name, array in arrays.items() if array is not None}
    # A 0-d unicode array loads back without pickle.
    arrays["metadata"] = np.array(json.dumps(dict(metadata or {}), sort_keys=True))
    with atomic_open(path, "wb") as handle:
        np.savez(handle, **arrays)


def _is_npz(path: PathLike) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC


def read_logprob_dump(path: PathLike) -> LogprobRun:
    """Read either dump format; the format is recognised from the content."""
    if _is_npz(path):
        return _read_npz(path)
    return _read_article_json(path)


def read_logprob_metadata(path: PathLike) -> dict[str, Any]:
    """The metadata stored in an fp8gate dump; {} for the article's JSON format."""
    if not _is_npz(path):
        return {}
    stored = _load_npz(path, ("metadata",)).get("metadata")
    if stored is None:
        return {}
    try:
        metadata = json.loads(stored.item())
    except (ValueError, TypeError):
        metadata = None
    if not isinstance(metadata, dict):
        raise DumpFormatError(path, "metadata as a JSON object string")
    return metadata


def dump_run_id(path: PathLike) -> str | None:
    """The gate run that wrote a log-prob dump; None for dumps from other tools."""
    run_id = read_logprob_metadata(path).get(RUN_ID)
    return None if run_id is None else str(run_id)


def samples_run_id(path: PathLike) -> str | None:
    """The gate run that wrote a samples file; None for lm-eval's own files."""
    seen = set()
    with open(path, "rb") as handle:
        for line in handle:
            try:
                row = json.loads(line) if line.strip() else {}
            except ValueError:
                continue  # read_lm_eval_samples reports the line
            if isinstance(row, dict):
                seen.add(row.get(SAMPLES_RUN_ID))
    ids = sorted(str(i) for i in seen if i is not None)
    if len(ids) > 1 or (ids and None in seen):
        raise DumpFormatError(path, f"{_SAMPLES_FORMAT} of one gate run; rows of runs {', '.join(ids)} are mixed")
    return ids[0] if ids else None


def _load_npz(path: PathLike, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The named arrays that the archive holds (members load lazily, so only those)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in names if name in archive.files}
    except (ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DumpFormatError(path, f"{_NPZ_FORMAT} ({err})") from err


def _read_npz(path: PathLike) -> LogprobRun:
    arrays = _load_npz(path, _REQUIRED_ARRAYS + _OPTIONAL_ARRAYS)
    missing = [name for name in _REQUIRED_ARRAYS if name not in arrays]
    if missing:
        raise DumpFormatError(path, f"{_NPZ_FORMAT}; missing {', '.join(missing)}")
    try:
        return LogprobRun(**arrays)
    except ValueError as err:
        raise DumpFormatError(path, f"{_NPZ_FORMAT} with consistent shapes and valid values ({err})") from err


def _read_article_json(path: PathLike) -> LogprobRun:
    try:
        with open(path, encoding="utf-8") as handle:
            rows = json.load(handle)
    except (ValueError, UnicodeDecodeError) as err:
        raise DumpFormatError(path, f"{_ARTICLE_FORMAT} or {_NPZ_FORMAT} ({err})") from err
    if not isinstance(rows, list) or not rows:
        raise DumpFormatError(path, f"{_ARTICLE_FORMAT}, non-empty")
    try:
        # No dtype on purpose: the inferred one reveals nulls, strings, floats in "top".
        real = np.array([row["real"] for row in rows])
        top = np.array([row["top"] for row in rows])
    except (KeyError, TypeError, IndexError):
        real = top = np.empty(0, dtype=object)
    if real.dtype.kind not in "if" or top.dtype.kind != "i":
        raise DumpFormatError(path, f"{_ARTICLE_FORMAT}; {_first_bad_article_row(rows)}")
    if not np.isfinite(real).all():
        # JSON's -Infinity (probability 0) or NaN: every mean over positions would be inf or nan.
        index = int(np.flatnonzero(~np.isfinite(real))[0])
        raise DumpFormatError(path, f"{_ARTICLE_FORMAT} with finite log-probs; row {index} has real = "
                                    f"{json.dumps(float(real[index]))}, which makes the perplexity and KL "
                                    "undefined")
    try:
        return LogprobRun(
            real_logprob=real,
            top_ids=top[:, None],
            # The article's dump records which token was top, not its log-prob.
            top_logprobs=np.full((len(rows), 1), np.nan),
        )
    except ValueError as err:
        raise DumpFormatError(path, f"{_ARTICLE_FORMAT} ({err})") from err


def _first_bad_article_row(rows: list[Any]) -> str:
    for index, row in enumerate(rows):
        valid = (
            isinstance(row, dict)
            and type(row.get("real")) in (int, float)
            and type(row.get("top")) is int
        )
        if not valid:
            return f"row {index} is {json.dumps(row)[:80]}"
    return "the values do not fit 64-bit numbers"


def read_lm_eval_samples(
    path: PathLike, filter_name: str = "strict-match", metric: str | None = None
) -> list[AnswerRecord]:
    """Graded answers from an lm-eval ``--log_samples`` JSONL file.

    Keeps the rows of one filter. ``metric`` defaults to the first name in each
    row's ``metrics`` list; it must be a 0/1 score (exact_match, acc), and an
    answer is correct when it is 1.
    """
    records = []
    filters_seen: set[str] = set()
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{_SAMPLES_FORMAT}; line {line_number}"
            try:
                row = json.loads(line)
            except ValueError as err:  # includes undecodable bytes
                raise DumpFormatError(path, f"{where} is not JSON ({err})") from err
            if not isinstance(row, dict) or "doc_id" not in row or "filter" not in row:
                raise DumpFormatError(path, f"{where} lacks doc_id or filter")
            filters_seen.add(str(row["filter"]))
            if row["filter"] == filter_name:
                records.append(_answer_record(path, where, row, metric))
    if not records:
        seen = ", ".join(sorted(filters_seen)) or "none"
        raise DumpFormatError(
            path, f"{_SAMPLES_FORMAT} with filter {filter_name!r} (filters present: {seen})"
        )
    return records


def _rows_under(path: PathLike, filter_name: str) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as handle:
        for line in handle:
            row = json.loads(line) if line.strip() else None
            if isinstance(row, dict) and row.get("filter") == filter_name:
                yield row


def read_lm_eval_generations(path: PathLike, filter_name: str) -> dict[Any, str]:
    """The raw generated text (``resps``, before any filter) of each doc under one filter."""
    generations = {}
    for row in _rows_under(path, filter_name):
        resps = row.get("resps")
        # One request per doc for generate_until tasks: [[text]].
        while isinstance(resps, list) and len(resps) == 1:
            resps = resps[0]
        generations[row.get("doc_id")] = resps if isinstance(resps, str) else json.dumps(resps)
    return generations


def _gate_field(path: PathLike, filter_name: str, field: str) -> dict[Any, Any]:
    """Each doc's value of a field the gate wrote beside lm-eval's row, under one filter; DumpFormatError
    when a row has none."""
    values = {}
    for row in _rows_under(path, filter_name):
        if field not in row:
            raise DumpFormatError(path, f"{_SAMPLES_FORMAT} with a {field!r} field (doc "
                                        f"{row.get('doc_id')!r} has none: written before the gate recorded it, "
                                        "or by another harness)")
        values[row.get("doc_id")] = row[field]
    return values


def read_finish_reasons(path: PathLike, filter_name: str) -> dict[Any, Any]:
    """Each doc's ``finish_reason`` under one filter (a string, or a list for a doc of several requests)."""
    return _gate_field(path, filter_name, FINISH_REASON)


def read_thinking_chars(path: PathLike, filter_name: str) -> dict[Any, Any]:
    """Each doc's thinking length in characters under one filter (None: no think_end marker; a list for
    a doc of several requests)."""
    return _gate_field(path, filter_name, THINKING_CHARS)


def _answer_record(
    path: PathLike, where: str, row: dict[str, Any], metric: str | None
) -> AnswerRecord:
    if metric is None:
        metrics = row.get("metrics")
        if not isinstance(metrics, list) or not metrics:
            raise DumpFormatError(path, f"{where} has no 'metrics' list; pass a metric name")
        metric = str(metrics[0])
    value = row.get(metric)
    if value not in (0, 1):
        raise DumpFormatError(
            path, f"{where}: expected {metric!r} to be a 0/1 score, got {value!r}"
        )
    return AnswerRecord(
        doc_id=row["doc_id"],
        filter=row["filter"],
        correct=value == 1,
        prompt_hash=row.get("prompt_hash"),
        response=_as_text(row.get("filtered_resps")),
        target=_as_text(row.get("target")),
    )


def _as_text(value: Any) -> str:
    # filtered_resps is usually a one-element list (["23"] after take_first).
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, str) else json.dumps(value)


def _to_json(value: Any) -> Any:
    # lm-eval rows carry numpy scalars (exact_match is a numpy.float64).
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_lm_eval_samples(path: PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write lm-eval sample rows as JSONL, atomically."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, default=_to_json) + "\n")
