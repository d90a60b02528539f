"""README examples that run on a CPU in a second are executed, so they stay true."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_objectives_example_runs():
    section = README.split("## Objectives", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md#objectives", "exec"), namespace)
    assert namespace["out"].loss.requires_grad and type(namespace["dapo"]).__name__ == "GRPO"


def test_readme_test_command_is_what_ci_runs():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "test-command" in ci
    block = README.split("<!-- test-command -->", 1)[1].split("<!-- /test-command -->", 1)[0]
    assert "python3 -m venv .venv-test" in block and "pytest" in block
