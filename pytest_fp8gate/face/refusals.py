"""A run with a thresholds file must gate something.

Refused: a run that selects none of the file's rule tests (never collected, or
all deselected), or only rule tests skipped before they run (candidates this
machine's engine cannot run), unless --fp8gate-allow-no-rules; with --fp8gate-require-gpu, a
run in which no rule test ran on a GPU. A file found in rootdir only implicitly
is refused only with --fp8gate-require-gpu (a gate run); otherwise the summary
says it gated nothing, so that a project's unit tests can live beside it.
Refused outright: a run distributed by pytest-xdist.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..config.spec import GateConfig
from ..options import Settings, display_path
from .collect import is_rule
from .session import RuleTally, RunState

ALLOW_NO_RULES = "--fp8gate-allow-no-rules"


def check_toml_args(config: pytest.Config, configured: Path | None) -> None:
    """A TOML file given to pytest that is not the configured one would be "not found": say why."""
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path.suffix == ".toml" and path.is_file() and path != (configured and configured.resolve()):
            which = f"the gate's is {display_path(configured)}" if configured else "none is configured"
            raise pytest.UsageError(f"{arg}: not the gate's thresholds file ({which}); "
                                    f"pass --fp8gate-config {arg} to gate with it")


def check_not_distributed(config: pytest.Config) -> None:
    """Refuse pytest-xdist: the gate holds one engine at a time, in one process."""
    # xdist's options exist only where it is installed; a worker has them reset and carries workerinput.
    worker = getattr(config, "workerinput", {}).get("workerid")
    workers, dist = config.getoption("numprocesses", None), config.getoption("dist", "no")
    if worker or workers or dist != "no":
        how = f"worker {worker}" if worker else f"-n {workers}" if workers else f"--dist {dist}"
        raise pytest.UsageError(f"fp8gate cannot run under pytest-xdist ({how}): every worker would start "
                                "its own baseline engine on the same GPU; run the gate without -n")


def count_deselected(tally: RuleTally, items: list[pytest.Item]) -> None:
    tally.deselected += sum(map(is_rule, items))


def check_selection(session: pytest.Session, settings: Settings, gate: GateConfig, tally: RuleTally) -> None:
    """Raise UsageError when the run selected no rule test that can be judged and that is not allowed."""
    rules = [item for item in session.items if is_rule(item)]
    tally.gpu_rules = {item.nodeid for item in rules if item.get_closest_marker("gpu")}
    if settings.allow_no_rules or session.config.getoption("collectonly"):
        return
    # A skip set at collection (a candidate this machine's engine cannot run, a CPU speed rule without a
    # bandwidth figure) leaves its rule unjudged. A gpu rule's skip where no GPU is visible is the
    # documented exception: the gate runs on the GPU runner, and --fp8gate-require-gpu refuses the skip.
    skips = [mark for item in rules if not item.get_closest_marker("gpu") and (mark := item.get_closest_marker("skip"))]
    if rules and len(skips) < len(rules):
        return
    path = display_path(gate.path)
    if rules:
        reasons = dict.fromkeys(str(mark.kwargs.get("reason", "skipped")) for mark in skips)
        why = (f"all {len(rules)} of its selected rule tests are skipped before they run, so nothing would be "
               f"judged ({'; '.join(reasons)})")
    elif tally.deselected:
        why = (f"all {tally.deselected} of its rule tests were deselected (-k, -m or --deselect); "
               "select at least one (e.g. -m fp8gate)")
    else:
        why = (f"none of its rule tests were collected; pass the file to pytest (pytest {path} ...) "
               "or add its directory to testpaths")
    message = f"{path} ({settings.config_source}): {why}, or pass {ALLOW_NO_RULES} to run without gating"
    if settings.config_explicit or settings.require_gpu:
        raise pytest.UsageError(message)
    tally.complaint = f"this run gated nothing: {message}"


def record_call(tally: RuleTally, item: pytest.Item) -> None:
    """A rule test's body is about to run (its setup, GPU check included, passed)."""
    if item.nodeid in tally.gpu_rules:
        tally.ran_on_gpu += 1


def check_gpu_ran(session: pytest.Session, settings: Settings, gate: GateConfig, tally: RuleTally) -> None:
    """With --fp8gate-require-gpu, fail a session in which no rule test ran on a GPU."""
    # Only a session that ran to the end: not a usage error or an interrupted one.
    finished = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED,
                                      pytest.ExitCode.NO_TESTS_COLLECTED)
    if not (settings.require_gpu and finished) or tally.ran_on_gpu \
            or session.config.getoption("collectonly"):
        return
    if not tally.gpu_rules:
        if settings.allow_no_rules:
            return
        why = f'{display_path(gate.path)} sets device = "cpu"' if gate.device == "cpu" else "no gpu rule was selected"
    else:
        why = f"all {len(tally.gpu_rules)} selected gpu rule tests were skipped or failed before running"
    tally.complaint = f"--fp8gate-require-gpu: no rule ran on a GPU ({why})"
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def finish(state: RunState, session: pytest.Session) -> None:
    if state.config is not None:
        check_gpu_ran(session, state.settings, state.config, state.tally)
