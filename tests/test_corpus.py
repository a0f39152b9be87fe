"""The probability check's chunks: tokenizing only the prefix the chunks use gives the very tokens
that tokenizing the whole text gives."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_fp8gate.checkpoint import UNKNOWN_VOCAB, vocab_size, vocab_size_hint
from pytest_fp8gate.config.spec import FileCorpus, ProbabilitySpec
from pytest_fp8gate.engines.base import Engine
from pytest_fp8gate.errors import CorpusError
from pytest_fp8gate.run import corpus

ASSETS = Path(corpus.__file__).parents[1] / "assets"


@pytest.fixture(scope="module")
def engine() -> SimpleNamespace:
    """The embedded model's own tokenizer behind the engine's ``encode``."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(ASSETS / "model")
    holder = SimpleNamespace(tokenizer=tokenizer)
    holder.encode = lambda text, add_bos: Engine.encode(holder, text, add_bos)  # type: ignore[arg-type]
    return holder


@pytest.mark.parametrize("needed", [1, 500, 4_000, 30_000, 10**9])
def test_the_leading_tokens_are_the_whole_texts(engine: SimpleNamespace, needed: int) -> None:
    text = (ASSETS / "corpus.txt").read_text(encoding="utf-8")
    whole = engine.encode(text, add_bos=False)
    assert corpus.leading_tokens(engine, text, needed) == whole[:needed]


def test_a_cut_inside_a_line_or_a_word_changes_no_kept_token(engine: SimpleNamespace) -> None:
    text = "no line ends here, only words and spaces   " * 400
    assert corpus.leading_tokens(engine, text, 700) == engine.encode(text, add_bos=False)[:700]


def test_the_chunks_start_with_bos_and_cover_the_text_in_order(engine: SimpleNamespace, tmp_path: Path) -> None:
    path = ASSETS / "corpus.txt"
    spec = ProbabilitySpec(corpus=FileCorpus(path), chunks=3, chunk_tokens=256)
    chunks = corpus.chunk_corpus(engine, spec, tmp_path / "thresholds.toml")
    whole = engine.encode(path.read_text(encoding="utf-8"), add_bos=False)
    bos = engine.tokenizer.bos_token_id
    assert [chunk[0] for chunk in chunks] == [bos] * 3
    assert sum((chunk[1:] for chunk in chunks), []) == whole[:3 * 255]


def test_the_vocabulary_hint_reads_a_multimodal_config_as_the_roofline_does(tmp_path: Path) -> None:
    # A wrapper's top-level vocab_size can count image tokens; the language model's is in text_config.
    config = {"vocab_size": 262_208, "text_config": {"vocab_size": 262_144}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vocab_size_hint(str(tmp_path)) == vocab_size(config) == 262_144
    assert vocab_size_hint(str(tmp_path / "absent")) == UNKNOWN_VOCAB


def test_more_chunks_than_the_text_holds_is_an_error_naming_both_counts(engine: SimpleNamespace, tmp_path: Path):
    path = ASSETS / "corpus.txt"
    tokens = len(engine.encode(path.read_text(encoding="utf-8"), add_bos=False))
    held = tokens // 1023
    spec = ProbabilitySpec(corpus=FileCorpus(path), chunks=held + 1, chunk_tokens=1024)
    with pytest.raises(CorpusError) as error:
        corpus.chunk_corpus(engine, spec, tmp_path / "thresholds.toml")
    assert str(error.value) == (
        f"{tmp_path / 'thresholds.toml'}: probabilities.chunks: {held + 1} chunks of 1024 tokens asked, but the "
        f"corpus holds {tokens:,} tokens with this model's tokenizer, {held} chunks; lower probabilities.chunks "
        f"to {held}, or give a longer corpus")
    assert len(corpus.chunk_corpus(engine, replace(spec, chunks=held), tmp_path / "thresholds.toml")) == held
