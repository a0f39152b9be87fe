"""Each [[tasks]] table: an lm-eval task, its protocol and its limits."""

from __future__ import annotations

from ..core import protocol
from . import checks, schema
from .reading import Reading, Table
from .spec import TaskLimits, TaskSpec


class TaskTables(Reading):
    """Reads one [[tasks]] table into a TaskSpec, refusing settings lm-eval would ignore or refuse."""

    def task(self, table: Table) -> TaskSpec:
        values = table.values(TaskSpec, schema.TASK_CHECKS)
        values["include_path"] = self.directory(table.key("include_path"), values["include_path"])
        if values["task"].endswith((".yaml", ".yml")) or "/" in values["task"]:
            # lm-eval would load a task file relative to the working directory and import its !function code.
            raise self.error(table.key("task"), f"expected a task name, got the file {values['task']!r}; "
                                                "put the YAML in a directory named by include_path")
        limits = table.table("limits", schema.TASK_LIMIT_CHECKS)
        spec = TaskSpec(
            name=table.get("name", checks.test_id_name, values["task"]),
            chat_template_kwargs=table.get("chat_template_kwargs", checks.template_kwargs, {}),
            limits=TaskLimits(**limits.values(TaskLimits, schema.TASK_LIMIT_CHECKS)),
            **values,
        )
        for key in ("fewshot_as_multiturn", "chat_template_kwargs"):
            if key in table.raw and getattr(spec, key) and not spec.apply_chat_template:
                raise self.error(table.key(key), "has no effect unless apply_chat_template = true")
        self.check_expected_protocol(table, spec)
        if spec.chat_template_kwargs.get("enable_thinking") is True and spec.think_end is None:
            # lm-eval refuses the same (think_end_token is required with enable_thinking=True).
            raise self.error(table.key("think_end"), "missing: chat_template_kwargs.enable_thinking = true makes "
                                                     "the model think before it answers; name the marker that "
                                                     'ends the thinking (e.g. "</think>") so that only the '
                                                     "answer after it is scored")
        return spec

    def check_expected_protocol(self, table: Table, spec: TaskSpec) -> None:
        """An expected_accuracy measured under another protocol than this file sets is refused here, before any
        engine starts; the keys only a run knows (the chat template's hash, lm-eval's default few-shot count, the
        task's stop strings) are checked when the baseline's accuracy is judged."""
        expected = spec.limits.expected_protocol
        if expected is None:
            return
        where = table.key("limits.expected_protocol")
        if spec.limits.expected_accuracy is None:
            raise self.error(where, "has no effect unless limits.expected_accuracy is set")
        found = protocol.difference(expected, spec.protocol())
        if found is not None:
            key, wanted, this_run = found
            raise self.error(f"{where}.{key}", f"expected_accuracy was measured under {key} = {protocol.show(wanted)}, "
                                               f"this task runs under {key} = {protocol.show(this_run)}")
