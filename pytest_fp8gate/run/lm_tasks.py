"""lm-eval's tasks as the gate configures them: the task manager, the names its index holds (asked without
building the whole index), and what stops a task before any engine starts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Container, Iterator, Sequence
from pathlib import Path
from typing import Any

import lm_eval

from ..config import checks
from ..config.spec import GateConfig, TaskSpec


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
