"""The demo runs under its own pytest settings, whatever project the user starts it from (no engine: the
demo's rule tests are only collected), as ``fp8gate demo`` runs from a shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_demo_ignores_the_pytest_settings_of_the_directory_it_runs_in(tmp_path: Path) -> None:
    # As in this project's own clone: its pyproject.toml turns the gate off for the project's suite.
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = ["-p", "no:fp8gate"]\n')
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from pytest_fp8gate.tools.cli import main; sys.exit(main())",
         "demo", "--", "--collect-only", "-q"],
        cwd=tmp_path, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_kl_within_limit[bf16-rerounded]" in done.stdout
