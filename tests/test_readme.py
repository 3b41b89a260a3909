"""The README's two commands: the test one is exactly what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_serve_then_test_commands():
    serve, test = readme_commands()[:2]
    assert serve.endswith("mlxq serve") and "pip install -e ." in serve
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    test = readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines


def test_ci_also_runs_the_slow_suites_the_readme_command_leaves_out():
    test = readme_commands()[1]
    assert test.endswith('pytest -q -m "not slow"')
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines.index("pytest -q -m slow") > ci_lines.index(test)
