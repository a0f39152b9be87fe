"""Which rule tests a run collects and runs: the thresholds file collected as the rules module,
the gpu rules skipped where no GPU is visible (or failed with --fp8gate-require-gpu), the
selection checked, and what each engine measures set from the rule tests that will run."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from .. import hardware
from ..judge.verdict import Case
from . import refusals
from .cases import needs_of
from .collect import ThresholdsFile, is_rule
from .session import RunState


def collect_file(state: RunState, file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if state.config is not None and file_path == state.config.path:
        return ThresholdsFile.from_parent(parent, path=file_path)
    return None


def skip_gpu_rules_without_gpu(state: RunState, items: list[pytest.Item]) -> None:
    # Only the gate's own rule tests: the user's other gpu-marked tests are theirs to skip.
    # A skip mark (not pytest.skip in setup) reports the skip at the test's own location.
    gpu_rules = [item for item in items if is_rule(item) and item.get_closest_marker("gpu")]
    if not gpu_rules or state.settings.require_gpu:
        return
    probe = hardware.probe_cuda()
    if not probe.names:
        skip = pytest.mark.skip(reason=f"no CUDA device visible ({probe.source})")
        for item in gpu_rules:
            item.add_marker(skip)


def finish_collection(state: RunState, session: pytest.Session) -> None:
    if state.config is not None:
        refusals.check_selection(session, state.settings, state.config, state.tally)
        # What each engine measures follows the rule tests left after -k/-m deselection that will run.
        cases = [cast(Case, item.callspec.params["case"]) for item in session.items
                 if is_rule(item) and not item.get_closest_marker("skip")]
        state.needs = needs_of(cases)
        state.cases = cases  # each candidate's rules that are tests share the run's false-alarm budget


def require_gpu(state: RunState, item: pytest.Item) -> None:
    if not (is_rule(item) and item.get_closest_marker("gpu")) or not state.settings.require_gpu:
        return
    probe = hardware.probe_cuda()
    if not probe.names:
        pytest.fail(
            f"--fp8gate-require-gpu: no CUDA device visible ({probe.source}); "
            "a deploy gate must never pass by skipping",
            pytrace=False,
        )
