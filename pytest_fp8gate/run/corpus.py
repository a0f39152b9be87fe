"""The probability check's text: load it, tokenize it once, cut it into chunks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config.spec import DatasetCorpus, FileCorpus, ProbabilitySpec
from ..errors import CorpusError

if TYPE_CHECKING:
    from ..engines.base import Engine

# Characters tokenized first for each token the chunks need (English runs about 4 a token); doubled
# until the prefix holds enough.
CHARS_PER_TOKEN = 8
# Tokens dropped at a prefix's end: only those can differ from the whole text's tokens (the cut
# may split a word or a run of white space, which the whole text tokenizes otherwise).
CUT_MARGIN = 64


def load_text(corpus: DatasetCorpus | FileCorpus) -> str:
    if isinstance(corpus, FileCorpus):
        return corpus.path.read_text(encoding="utf-8")
    import datasets  # only on runners that fetch the corpus

    rows = datasets.load_dataset(corpus.dataset, corpus.name, split=corpus.split)
    # wikitext rows keep their own newlines, so plain concatenation restores the raw file.
    return "".join(rows[corpus.column])


def chunk_corpus(engine: "Engine", spec: ProbabilitySpec, config_path: Path) -> list[list[int]]:
    """``spec.chunks`` chunks of ``spec.chunk_tokens`` tokens, each starting with BOS.

    Every chunk is scored on its own, so each gets the BOS a fresh prompt has.
    A text too short for all of them is an error: a run of fewer chunks would judge on less evidence
    than the thresholds file asks for, without a word.
    """
    bos = engine.tokenizer.bos_token_id
    prefix = [] if bos is None else [bos]
    body = spec.chunk_tokens - len(prefix)
    ids = leading_tokens(engine, load_text(spec.corpus), spec.chunks * body)
    count = len(ids) // body
    if count < spec.chunks:
        fix = f"probabilities.chunks to {count}" if count else "probabilities.chunk_tokens"
        raise CorpusError(
            f"{config_path}: probabilities.chunks: {spec.chunks} chunks of {spec.chunk_tokens} tokens asked, but "
            f"the corpus holds {len(ids):,} tokens with this model's tokenizer, {count} chunks; lower {fix}, "
            "or give a longer corpus"
        )
    return [prefix + ids[i * body:(i + 1) * body] for i in range(spec.chunks)]


def leading_tokens(engine: "Engine", text: str, needed: int) -> list[int]:
    """The whole text's first ``needed`` tokens (all of them if it has fewer), from a prefix of it:
    a corpus of millions of tokens is not tokenized for the thousands the chunks use."""
    length = needed * CHARS_PER_TOKEN
    while length < len(text):
        cut = text.rfind("\n", 0, length) + 1 or length  # after a line's end, where the prefix has one
        ids = engine.encode(text[:cut], add_bos=False)
        if len(ids) - CUT_MARGIN >= needed:
            return ids[:needed]
        length *= 2
    return engine.encode(text, add_bos=False)[:needed]
