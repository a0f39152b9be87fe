"""The [noise], [decode] and [probabilities] tables, with the corpus the probabilities are scored on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from . import checks, schema
from .reading import Reading, Table
from .spec import (
    PROBABILITY_RULE_BY_LIMIT,
    REFERENCES,
    WIKITEXT_2,
    DatasetCorpus,
    DecodeLimits,
    DecodeSpec,
    FileCorpus,
    ModelSpec,
    NoiseSpec,
    ProbabilityLimits,
    ProbabilitySpec,
)

_CORPUS_FORMS = '"wikitext-2", a text file or a table {dataset = ...}'


class MeasureTables(Reading):
    """Reads [noise], [decode] and [probabilities], the last with its corpus and chunk size."""

    def noise(self, table: Table) -> NoiseSpec:
        return NoiseSpec(tuple(table.get("passes", checks.noise_passes, NoiseSpec.passes)),
                         tuple(table.get("candidate_passes", checks.candidate_passes, NoiseSpec.candidate_passes)))

    def decode(self, table: Table) -> DecodeSpec:
        limits = table.table("limits", schema.DECODE_LIMIT_CHECKS)
        if not any(key in limits.raw for key in schema.DECODE_METRIC_LIMITS):
            expected = ", ".join(schema.DECODE_METRIC_LIMITS)
            raise self.error(limits.where, f"expected at least one of {expected}; nothing is gated")
        return DecodeSpec(limits=DecodeLimits(**limits.values(DecodeLimits, schema.DECODE_LIMIT_CHECKS)),
                          **table.values(DecodeSpec, schema.DECODE_CHECKS))

    def probabilities(self, table: Table, models: Sequence[ModelSpec]) -> ProbabilitySpec:
        limits = table.table("limits", schema.PROBABILITY_LIMIT_CHECKS)
        if not any(key in limits.raw for key in (*schema.PROBABILITY_METRIC_LIMITS, "reference")):
            expected = ", ".join(schema.PROBABILITY_METRIC_LIMITS)
            raise self.error(limits.where, f"expected at least one of {expected}, or a reference; nothing is gated")
        if "reference_ratio" in limits.raw and "reference" not in limits.raw:
            raise self.error(limits.key("reference_ratio"), "needs reference, the build its factors multiply "
                                                            f"(one of {', '.join(map(repr, REFERENCES))})")
        for metric_limit in schema.PROBABILITY_METRIC_LIMITS:
            rule_name = PROBABILITY_RULE_BY_LIMIT[metric_limit]
            if metric_limit in limits.raw and rule_name in limits.raw.get("reference_ratio", {}):
                raise self.error(limits.key(metric_limit), f"set beside reference_ratio.{rule_name}: give the limit "
                                                           "as a value or as a factor over the reference, not both")
        values = table.values(ProbabilitySpec, schema.PROBABILITY_CHECKS)
        if values.get("chunk_tokens") == checks.MAX_MODEL_LEN:
            values["chunk_tokens"] = self.longest_chunk(table.key("chunk_tokens"), models)
        spec = ProbabilitySpec(
            corpus=self.corpus(table.key("corpus"), table.raw.get("corpus", "wikitext-2")),
            limits=ProbabilityLimits(**limits.values(ProbabilityLimits, schema.PROBABILITY_LIMIT_CHECKS)),
            **values,
        )
        served = models[0].served
        if spec.measured_references and served is not None and not served.managed:
            where = limits.key("reference") if "reference" in limits.raw else table.key("references")
            raise self.error(where, "a reference build is written from the baseline's weights and served as the "
                                    "baseline is; the baseline here is an endpoint the gate does not start: give "
                                    "its limits as values, or name it by its serve line or its model")
        if isinstance(spec.corpus, FileCorpus):
            self.corpus_holds_the_chunks(table.key("chunks"), spec.corpus.path, spec.chunks, spec.chunk_tokens)
        return spec

    def corpus_holds_the_chunks(self, where: str, path: Path, chunks: int, chunk_tokens: int) -> None:
        """A text file of fewer bytes than the chunks' tokens cannot fill them with any tokenizer the gate meets
        (a byte-level or byte-fallback token covers at least one byte), so this is known before any engine;
        the exact count needs the model's tokenizer (run/corpus.py)."""
        size = path.stat().st_size
        most = size // (chunk_tokens - 1)  # a chunk's text is all but its BOS
        if most < chunks:
            fix = f"probabilities.chunks to {most}" if most else "probabilities.chunk_tokens"
            raise self.error(where, f"{chunks} chunks of {chunk_tokens} tokens asked, but the corpus {path} has "
                                    f"{size:,} bytes, room for at most {most} (a token covers at least one byte); "
                                    f"lower {fix}, or give a longer corpus")

    def longest_chunk(self, where: str, models: Sequence[ModelSpec]) -> int:
        """chunk_tokens = "max_model_len": the least context of the models (engine.max_model_len where set, else
        a local checkpoint's max_position_embeddings), less the one token vLLM generates after a scored prompt."""
        lengths = []
        for spec in models:
            config = self.model_configs.get(spec.model, {})
            length = spec.engine.get("max_model_len") or config.get("max_position_embeddings") \
                or config.get("text_config", {}).get("max_position_embeddings")
            if not isinstance(length, int) or isinstance(length, bool):
                raise self.error(where, f'"{checks.MAX_MODEL_LEN}" needs the context of each model, but {spec.name} '
                                        "has no engine.max_model_len and no local config.json max_position_embeddings; "
                                        "set one, or chunk_tokens to a number")
            lengths.append(length)
        if min(lengths) < 3:
            raise self.error(where, f"a context of {min(lengths)} tokens leaves no position to score")
        return min(lengths) - 1

    def corpus(self, where: str, value: Any) -> DatasetCorpus | FileCorpus:
        if value == "wikitext-2":
            return WIKITEXT_2
        if isinstance(value, dict):
            table = Table(self, where, value, schema.DATASET_CHECKS)
            return DatasetCorpus(**table.values(DatasetCorpus, schema.DATASET_CHECKS))
        if not isinstance(value, str) or not value:
            raise self.error(where, f"expected {_CORPUS_FORMS}, got {checks.show(value)}")
        path = self.resolve(value)
        if not path.is_file():
            raise self.error(where, f"file not found: {path} (expected {_CORPUS_FORMS})")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.error(where, f"{path}: not UTF-8 text (byte {err.start})") from None
        if not text.strip():
            raise self.error(where, f"{path}: no text to score")
        return FileCorpus(path)
