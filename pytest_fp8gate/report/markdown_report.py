"""The gate's markdown report: per candidate, verdicts, speed, flips, plots, recompute commands; then provenance.

Tables are padded so the file reads as plain text too. The same text goes to
``--fp8gate-report PATH`` (with PNG plots next to it) and to GitHub's
``$GITHUB_STEP_SUMMARY`` (which cannot show local images, so it names them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.spec import GateConfig, TaskSpec
from ..core import rules
from ..core.answers import AnswerComparison, FlippedAnswer
from ..core.dumps import read_lm_eval_generations
from ..engines import stack
from ..judge.comparisons import Comparisons
from ..judge.fidelity import SIDE_BY_SIDE
from ..judge.recompute import compare_logprobs_command, flips_command
from ..judge.verdict import BUDGET, Case, Verdict
from ..options import display_path
from ..run.record import PASS_DESCRIPTIONS, BaselineRecord, ModelResult
from . import plots

FLIPS_SHOWN = 20  # per candidate and task; the recompute command lists them all
CONTEXT_WORDS = 6
SUMMARY_LIMIT = 1 << 20  # GitHub refuses a step summary above 1 MiB
_IMAGE = re.compile(r"^!\[(.*)\]\((.*)\)$", re.MULTILINE)


@dataclass
class ReportData:
    """What one session measured and decided."""

    config: GateConfig
    verdicts: list[Verdict]
    baseline: BaselineRecord | None
    candidates: dict[str, ModelResult]
    provenance: dict[str, Any]  # environment, inputs, lm_eval_seeds, models, engine_runs
    comparisons: Comparisons  # the verdicts' own
    unjudged: list[tuple[Case, str]] = field(default_factory=list)  # rule cases without a verdict, and why
    time: dict[str, Any] | None = None  # timing.TimeLedger.as_dict(): where the session's wall time went


@dataclass
class Rendered:
    markdown: str
    summary: str  # for $GITHUB_STEP_SUMMARY: no local image links
    plots: list[Path]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table padded to column widths, so it also lines up as plain text."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def noise_floor_text(verdict: Verdict) -> str:
    """The noise floor the rule compared against, as a table cell."""
    if "noise_floor" in verdict.outcome.figures:
        return _number(verdict.outcome.figures["noise_floor"])
    floors = verdict.details.get("noise_floor") or {}
    accuracies = [f"{label} {c['accuracy_cand']:.4g}" for label, c in floors.items() if "accuracy_cand" in c]
    return ", ".join(accuracies) or "-"


def first_divergence(base: str, cand: str) -> str:
    """Where two generations part, by whitespace-separated word, with the words before it."""
    a, b = base.split(), cand.split()
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if index == len(a) == len(b):
        return "the generations are the same word for word (the answers differ in extraction only)"
    before = " ".join(a[max(0, index - CONTEXT_WORDS):index])
    lead = f"word {index + 1}, after “{before}”" if before else "word 1"

    def rest(words: list[str]) -> str:
        return "“" + " ".join(words[index:index + CONTEXT_WORDS]) + "”" if index < len(words) else "(ends)"

    return f"{lead}: baseline {rest(a)}, candidate {rest(b)}"


class _Candidate:
    """Renders one candidate's section."""

    def __init__(self, data: ReportData, name: str, plot_dir: Path | None, stem: str) -> None:
        self.data, self.name, self.plot_dir, self.stem = data, name, plot_dir, stem
        self.verdicts = [v for v in data.verdicts if v.case.candidate == name]
        self.result = data.candidates.get(name)
        self.plots: list[tuple[str, Path]] = []

    def lines(self) -> list[str]:
        unjudged = [(case, why) for case, why in self.data.unjudged if case.candidate == self.name]
        failed = [v for v in self.verdicts if not v.passed]
        errors = any(why.startswith("error") for _, why in unjudged)
        state = "FAIL" if failed or errors else "pass" if self.verdicts else "not judged"
        lines = [f"## {self.name}: {state}", ""]
        if self.result is not None:
            lines += [f"{self.result.spec.model}, quantization={self.result.spec.quantization}", ""]
        rows = [(v.outcome.rule, v.case.task or "-", _number(v.outcome.measured), noise_floor_text(v),
                 _number(v.outcome.limit), f"{v.outcome.margin:+.6g}", "pass" if v.passed else "**FAIL**")
                for v in self.verdicts]
        if rows:
            lines += table(("rule", "task", "measured", "noise floor", "threshold", "margin", "result"), rows)
            lines.append("")
        # Outside the table: a skip reason is a sentence, and would make every row that wide.
        lines += [f"Not judged: {case.rule}{f' on {case.task}' if case.task else ''}: {why}" for case, why in unjudged]
        lines += [""] if unjudged else []
        lines += _budget_lines(self.verdicts)
        lines += _decode_lines(self.verdicts)
        lines += _bucket_lines(self.verdicts)
        lines += self.speed_lines() + [""]
        lines += self.load_lines()
        for task in self.data.config.tasks:
            lines += self.flip_lines(task)
        lines += self.plot_lines()
        lines += self.command_lines()
        return lines

    def speed_lines(self) -> list[str]:
        base = self.data.baseline.result if self.data.baseline else None
        speed = next((v for v in self.verdicts if v.case.rule == rules.SPEED), None)
        if self.result is None:
            return ["Speed and KV cache: the candidate was not measured."]
        latency = self.result.latency
        if latency is None:
            text = "Speed: not measured (no decode-speed rule ran for this candidate)."
        else:
            text = (f"Speed: decode {latency.decode_tok_s:.1f} tok/s at batch {latency.batch_size}, "
                    f"{latency.input_len} tokens in, {latency.output_len} out, median of {latency.iters}"
                    + (f" (SE of the mean {latency.decode_rel_se:.2%}" if latency.decode_rel_se is not None else "")
                    + (f", target {latency.target_rel_se:.2%})" if latency.target_rel_se is not None
                       else ")" if latency.decode_rel_se is not None else ""))
            if base is not None and base.latency is not None:
                text += f" (baseline {base.latency.decode_tok_s:.1f} tok/s, " \
                        f"{latency.decode_tok_s / base.latency.decode_tok_s:.2f}x)"
            if speed is not None:
                figures = speed.outcome.figures
                text += (f"; {figures['candidate_share']:.1%} of its {figures['candidate_ceiling_tok_s']:.1f} "
                         f"tok/s bandwidth ceiling (baseline {figures['baseline_share']:.1%} of "
                         f"{figures['baseline_ceiling_tok_s']:.1f}); the bytes allow "
                         f"{figures['allowed_speedup']:.2f}x")
            text += "."
        kv = f"KV-cache capacity: {_tokens(self.result.kv_cache_tokens)}"
        if base is not None:
            kv += f" (baseline {_tokens(base.kv_cache_tokens)}"
            if self.result.kv_cache_tokens and base.kv_cache_tokens:
                kv += f", {self.result.kv_cache_tokens / base.kv_cache_tokens:.2f}x"
            kv += ")"
        return [text, "", kv + "."]

    def load_lines(self) -> list[str]:
        """[load]'s levels of both models side by side, where both were measured."""
        base = self.data.baseline.result if self.data.baseline else None
        if self.result is None or self.result.load is None or base is None or base.load is None:
            return []
        rows = [(str(own.concurrency), b["tok_s"], c["tok_s"], fraction, f"{c['ttft_p50']} / {c['ttft_p99']}",
                 f"{c['tpot_p50']} / {c['tpot_p99']}")
                for own, c, b, fraction in rules.shown_level_pairs(self.result.load, base.load)]
        return ["Speed under load (served):", "", *table(("concurrency", "baseline tok/s", "candidate tok/s",
                                                          "fraction", "candidate TTFT p50 / p99 s",
                                                          "candidate TPOT p50 / p99 ms"), rows), ""]

    def comparisons(self, task: TaskSpec) -> tuple[AnswerComparison, dict[str, AnswerComparison]] | None:
        baseline = self.data.baseline
        if baseline is None or self.result is None or task.name not in self.result.main.samples \
                or task.name not in baseline.result.main.samples:
            return None
        return self.data.comparisons.answers(self.name, task)

    def flip_lines(self, task: TaskSpec) -> list[str]:
        found = self.comparisons(task)
        if found is None:
            return []
        comparison, floors = found
        floor_text = ", ".join(f"{label} {c.flips}" for label, c in floors.items()) or "none measured"
        lines = [f"### Flipped questions on {task.name}: {comparison.flips} of {comparison.questions} "
                 f"({comparison.right_to_wrong} right → wrong, {comparison.wrong_to_right} wrong → right; "
                 f"noise floor: {floor_text})", ""]
        if task.think_end is not None:  # the answers were scored after the thinking; its length beside them
            lines += [f"Thinking before {task.think_end!r} (not scored): {who}: {thinking.text()}"
                      for who, thinking in self.data.comparisons.thinking(self.name, task).items()] + [""]
        assert self.data.baseline is not None and self.result is not None
        base_text = read_lm_eval_generations(self.data.baseline.result.main.samples[task.name], task.filter)
        cand_text = read_lm_eval_generations(self.result.main.samples[task.name], task.filter)
        for flip in comparison.flipped[:FLIPS_SHOWN]:
            lines += _flip_lines(flip, base_text.get(flip.doc_id, ""), cand_text.get(flip.doc_id, ""))
        if comparison.flips > FLIPS_SHOWN:
            lines.append(f"- … {comparison.flips - FLIPS_SHOWN} more (the flips command below lists all)")
        if not comparison.flipped:
            lines.append("No answer flipped.")
        lines.append("")
        self._flip_plot(task, comparison, floors)
        return lines

    def _flip_plot(self, task: TaskSpec, comparison: AnswerComparison, floors: dict[str, AnswerComparison]) -> None:
        if self.plot_dir is None or not plots.available():
            return
        verdict = next((v for v in self.verdicts if v.case.rule == rules.FLIPS and v.case.task == task.name), None)
        path = self.plot_dir / f"{self.stem}-{self.name}-flips-{task.name}.png"
        plots.flips_bars(comparison, floors, verdict.outcome.limit if verdict else None,
                         f"{self.name} on {task.name}: flips by direction against the noise floor", path)
        self.plots.append((f"flips on {task.name}", path))

    def plot_lines(self) -> list[str]:
        baseline = self.data.baseline
        base = baseline.result.main.logprobs if baseline else None
        cand = self.result.main.logprobs if self.result else None
        if self.plot_dir is not None and plots.available() and base is not None and cand is not None:
            assert baseline is not None
            floors = {label: run.logprobs for label, run in baseline.result.noise.items() if run.logprobs is not None}
            path = self.plot_dir / f"{self.stem}-{self.name}-dp.png"
            plots.delta_p_histogram(base, cand, floors, f"{self.name}: Δp per position against the noise floor",
                                    path)
            self.plots.insert(0, ("Δp per position", path))
            path = self.plot_dir / f"{self.stem}-{self.name}-kl.png"
            comparisons = self.data.comparisons
            if plots.kl_histogram(comparisons.logprobs(self.name), comparisons.logprob_floors(),
                                  f"{self.name}: KL per position against the noise floor", path):
                self.plots.insert(1, ("KL per position", path))
        if not self.plots:
            return []
        lines = ["### Plots", ""]
        lines += [f"![{self.name}: {label}]({path.name})" for label, path in self.plots]
        return lines + [""]

    def command_lines(self) -> list[str]:
        baseline = self.data.baseline
        if baseline is None or self.result is None:
            return []
        base, cand, noise = baseline.result.main, self.result.main, baseline.result.noise.items()
        # The candidate's command, then each noise pass's against the same baseline files.
        groups = [(compare_logprobs_command(base, cand),
                   [(label, compare_logprobs_command(base, run)) for label, run in noise])]
        groups += [(flips_command(base, cand, task), [(label, flips_command(base, run, task)) for label, run in noise])
                   for task in self.data.config.tasks]
        commands = []
        for main, floors in groups:
            if main is not None:
                commands.append(main)
                commands += [f"{command}   # noise floor: {label}" for label, command in floors if command]
        if not commands:
            return []
        return ["### Recompute from the artifacts", "", "```", *commands, "```", ""]


def _tokens(count: int | None) -> str:
    return "unknown" if count is None else f"{count:,} tokens"


def _flip_lines(flip: FlippedAnswer, base_text: str, cand_text: str) -> list[str]:
    direction = flip.direction.replace("_to_", " → ").replace("_", " ")
    return [f"- doc {flip.doc_id}, {direction}, target {_quote(flip.target)}: baseline answered "
            f"{_quote(flip.base_response)}, candidate {_quote(flip.cand_response)}",
            f"  first diverging {first_divergence(base_text, cand_text)}"]


def _quote(text: str, limit: int = 80) -> str:
    flat = " ".join(str(text).split())
    return "“" + (flat if len(flat) <= limit else flat[:limit - 1] + "…") + "”"


def _time_lines(time: dict[str, Any] | None) -> list[str]:
    if not time or time["wall_s"] <= 0:
        return []
    wall = time["wall_s"]
    rows = [[row["owner"], row["part"] + "".join(f"; {name} {value:.1f} s" for name, value in row["within"].items()),
             f"{row['seconds']:.1f}", f"{row['seconds'] / wall:.1%}"] for row in time["rows"]]
    return ["## Where the time went", "",
            f"{wall:.1f} s from the gate session's start to this report; each second in one row "
            "(an engine start's phases are vLLM's own figures, inside its row).", "",
            *table(("owner", "part", "seconds", "share"), rows), ""]


def _provenance_lines(data: ReportData) -> list[str]:
    p = data.provenance
    environment = p.get("environment", {})
    lines = ["## Provenance", ""]
    versions = environment.get("versions", {})
    lines += table(("component", "version"), [(k, v or "not installed") for k, v in versions.items()]
                   + [("python", environment.get("python", "?"))])
    devices = environment.get("devices", {})
    if devices.get("kind") == "cuda":
        lines += ["", f"GPUs: {', '.join(devices.get('gpus', []))} (driver {devices.get('driver')}, "
                      f"CUDA_VISIBLE_DEVICES={devices.get('cuda_visible_devices')})"]
    elif devices:
        lines += ["", f"CPU: {devices.get('cpu')}, {devices.get('cores')} cores ({devices.get('machine')})"]
    lines += ["", *table(("model", "id", "quantization", "revision", "snapshot", "weights sha256"),
                         [(name, m.get("model"), m.get("quantization") or "-", m.get("revision") or "-",
                           m.get("snapshot") or "-", (m.get("weights_sha256") or "not found locally")[:16])
                          for name, m in p.get("models", {}).items()])]
    runs = p.get("engine_runs", [])
    if runs:
        rows = [(r["label"], r["started_at"], f"{r['duration_s']:.1f} s", f"{r['startup_s']:.1f} s",
                 str(r.get("vllm", {}).get("seed", "-")),
                 ", ".join(f"{k}={v}" for k, v in sorted(r.get("kwargs", {}).items()) if k != "model"))
                for r in runs]
        lines += ["", *table(("engine", "started (UTC)", "ran", "startup", "vLLM seed", "settings that reached vLLM"),
                             rows)]
        lines += _stack_lines(runs)
    seeds = p.get("lm_eval_seeds")
    if seeds:
        lines += ["", "lm-eval seeds: " + ", ".join(f"{k}={v}" for k, v in seeds.items())]
    inputs = p.get("inputs", {})
    corpus = inputs.get("corpus")
    if corpus:
        lines += ["", "Corpus: " + ", ".join(f"{k}={v}" for k, v in corpus.items())]
    for task in inputs.get("tasks", []):
        digest = task.get("files_sha256") or task.get("builtin")
        lines.append(f"Task {task['name']} ({task['task']}): files sha256 {digest}, shots {task['num_fewshot']}, "
                     f"limit {task['limit']}, filter {task['filter']}, metric {task['metric']}, "
                     f"max_gen_toks {task['max_gen_toks']}")
    return lines + [""]


def _stack_lines(runs: list[dict[str, Any]]) -> list[str]:
    """What vLLM selected for each engine (stack.py), and its env table where it had one."""
    lines = ["", "What each engine ran (vLLM's selections):", ""]
    for run in runs:
        env = run.get("env")
        shown = f" (env: {', '.join(f'{k}={v}' for k, v in sorted(env.items()))})" if env else ""
        lines.append(f"- {run['label']}{shown}: {stack.summary(run.get('vllm', {}).get('stack'))}")
    return lines


def render(data: ReportData, plot_dir: Path | None, stem: str = "fp8gate") -> Rendered:
    """The report; with ``plot_dir``, PNG plots are drawn there and linked by file name."""
    config = data.config
    passed = sum(v.passed for v in data.verdicts)
    head = [f"# fp8gate report: {config.baseline.name} against {', '.join(c.name for c in config.candidates)}", "",
            f"Thresholds: {config.path}. Rules: {len(data.verdicts)} judged, {passed} passed, "
            f"{len(data.verdicts) - passed} failed, {len(data.unjudged)} not judged.", ""]
    if data.baseline is not None:
        head += [f"Baseline {config.baseline.name}: {data.baseline.origin}.", ""]
    if data.baseline is not None and data.baseline.result.noise:
        head += ["Noise floor passes: " + "; ".join(f"{label}: {PASS_DESCRIPTIONS.get(label, label)}"
                                                    for label in data.baseline.result.noise), ""]
    body: list[str] = []
    drawn: list[Path] = []
    for spec in config.candidates:
        section = _Candidate(data, spec.name, plot_dir, stem)
        body += section.lines()
        drawn += [path for _, path in section.plots]
    if plot_dir is None:
        body += ["Plots: not drawn (pass --fp8gate-report PATH to get PNGs next to the report).", ""]
    elif not plots.available():
        body += [f"Plots: not drawn: matplotlib is not installed ({plots.INSTALL_HINT}).", ""]
    markdown = "\n".join(head + body + _time_lines(data.time) + _provenance_lines(data))
    # The step summary cannot show files of the runner: name where each plot is instead.
    summary = _IMAGE.sub(lambda m: f"Plot {m[1]}: {display_path((plot_dir or Path()) / m[2])}", markdown)
    if len(summary.encode()) > SUMMARY_LIMIT:
        summary = summary.encode()[:SUMMARY_LIMIT - 200].decode(errors="ignore") + \
            "\n\n… cut at GitHub's 1 MiB step-summary limit; the full report is the --fp8gate-report file.\n"
    return Rendered(markdown + "\n", summary + "\n", drawn)


def write(data: ReportData, path: Path | None) -> list[Path]:
    """Write the report to ``path`` and append it to $GITHUB_STEP_SUMMARY; the files written."""
    from ..atomic import atomic_write_text

    written = []
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    rendered = render(data, path.parent if path is not None else None, path.stem if path is not None else "fp8gate")
    if path is not None:
        atomic_write_text(path, rendered.markdown)
        written += [path, *rendered.plots]
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as handle:  # appended: other steps write there too
            handle.write(rendered.summary)
        written.append(Path(summary))
    return written


def _budget_lines(verdicts: list[Verdict]) -> list[str]:
    """Each rule's share of the run's false-alarm budget and its power (additions): the p-value and the level
    it was tested at, and the smallest regression, in the rule's own unit, it catches with 80% power."""
    rows = []
    alpha = next((v.details[BUDGET]["run_alpha"] for v in verdicts if BUDGET in v.details), None)
    for v in verdicts:
        budget, figures = v.details.get(BUDGET), v.outcome.figures
        unit = next((label.split(" caught with ")[0] for label, _ in v.outcome.rows if " caught with " in label), "-")
        power = _number(figures["resolution"]) if "resolution" in figures and figures.get("limit_se", 1.0) else "-"
        spent = f"{budget['level']:.3g}" if budget else "-" if alpha is None else "none (not a test)"
        rows.append((v.outcome.rule, v.case.task or "-", "-" if budget is None else f"{budget['p_value']:.3g}",
                     spent, unit, power))
    if not rows:
        return []
    caught = ("\"caught\" is the smallest true regression, in the rule's unit, this run fails with 80% probability "
              "(\"-\": no SE measured)")
    head = (f"False alarms and power (additions): the rules that are tests share run_alpha = {alpha:g} by Holm (a "
            f"candidate with no real change fails any of them at most that often); {caught}." if alpha is not None
            else f"Power (an addition): {caught}; no run budget (run_alpha = 0, or no rule is a test).")
    return [head, "", *table(("rule", "task", "p", "level spent", "unit", "caught"), rows), ""]


def _decode_lines(verdicts: list[Verdict]) -> list[str]:
    """The decode-phase figures beside the prefill figures, once per candidate (the decode verdicts' details)."""
    seen: list[str] = []
    for verdict in verdicts:
        line = verdict.details.get(SIDE_BY_SIDE)
        if line and line not in seen:
            seen.append(line)
    return [f"Decode phase: {line}" for line in seen] + ([""] if seen else [])


# Where each check's per-bucket figures sit in its verdicts' details (LogprobComparison.as_dict, or the
# DecodeComparison's "logprobs"), and the rule kinds whose verdicts carry them.
_BUCKET_SOURCES = (("Probabilities", (rules.Kind.PROBABILITY, rules.Kind.BUCKET), ()),
                   ("Decode phase (baseline's continuations)", (rules.Kind.DECODE,), ("logprobs",)))


def _bucket_lines(verdicts: list[Verdict]) -> list[str]:
    """The probability and decode figures per position bucket (issue 34), beside the noise floor's worst KL in
    the same bucket: from the first verdict of each check, shown whether or not a bucket rule is configured."""
    lines: list[str] = []
    for title, kinds, path in _BUCKET_SOURCES:
        found = next((v for v in verdicts if rules.BY_NAME[v.case.rule].kind in kinds
                      and rules.BY_NAME[v.case.rule].bound is not None and "comparison" in v.details), None)
        if found is None:
            continue
        comparison, floors = _at(found.details["comparison"], path), found.details.get("noise_floor", {})
        floor_buckets = [{b["bucket"]: b for b in _at(floor, path).get("buckets", [])} for floor in floors.values()]
        rows = []
        for b in comparison.get("buckets", []):
            floor_kl = [f[b["bucket"]]["mean_kl"] for f in floor_buckets
                        if b["bucket"] in f and f[b["bucket"]]["mean_kl"] is not None]
            rows.append((b["bucket"], str(b["positions"]), f"{b['same_top']:.5f}", f"{b['rms_dp']:.5f}",
                         _number(b["mean_kl"]), f"{b['ppl_ratio']:.6f}", _number(max(floor_kl, default=None))))
        if rows:
            lines += [f"{title} per position bucket (positions in tokens; the whole: {comparison['positions']} "
                      f"positions, mean KL {_number(comparison['mean_kl'])}):", ""]
            lines += table(("bucket", "positions", "same top", "RMS Δp", "mean KL", "PPL ratio",
                            "noise floor mean KL"), rows)
            lines.append("")
    return lines


def _at(figures: dict[str, Any], path: Sequence[str]) -> dict[str, Any]:
    for key in path:
        figures = figures[key]
    return figures
