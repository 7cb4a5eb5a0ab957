"""The README's quick start runs as written, and its links resolve."""

from __future__ import annotations

import os
import re

from _processes import REPO_ROOT, run_in_process

README = os.path.join(REPO_ROOT, "README.md")


def _section(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def quick_start_code() -> str:
    match = re.search(r"```python\n(.*?)```", _section("Quick start"), re.S)
    assert match, "the README's quick start has no python block"
    return match.group(1)


def run_quick_start(index: int, workdir: str) -> dict:
    """Child process: run the quick start in `workdir` (it writes run.csv)."""
    os.chdir(workdir)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(quick_start_code(), "README quick start", "exec"), namespace)
    model = namespace["model"]
    with open("run.csv") as f:
        header = f.readline().strip().split(",")
    return {
        "updates": int(model.optimizer.iterations.numpy()),
        "columns": header,
        "micro_steps": int(model.optimizer.micro_steps.numpy()),
    }


def test_the_quick_start_runs_as_written(tmp_path):
    result = run_in_process(
        "test_readme:run_quick_start", timeout=240, args=(str(tmp_path),)
    )
    # 4096 samples / 64 per step = 64 micro-steps per epoch, 3 epochs.
    assert result["micro_steps"] == 3 * 64
    assert result["updates"] == 3 * 64 // 4
    assert "learning_rate" in result["columns"]
    assert any(c.startswith("mem/") for c in result["columns"])


def test_the_readme_links_resolve():
    text = open(README, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)#]+\.md)\)", text):
        assert os.path.exists(os.path.join(REPO_ROOT, target)), target


def test_the_readme_has_the_two_set_up_commands_first():
    text = open(README, encoding="utf-8").read()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 2
    assert lines[1].endswith("tests/run_suite.py")
    assert len(text.splitlines()) <= 200


def _extras_closure(extras: set[str]) -> list[str]:
    """Every requirement the extras pull from pyproject.toml, with the
    extras they name in turn."""
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = list(project["dependencies"])
    for extra in sorted(extras):
        requirements += project["optional-dependencies"][extra]
    return requirements


def test_the_first_command_is_light_on_a_machine_without_a_gpu():
    """The first command must not pull TensorFlow's CUDA wheels (about 7 GB,
    cuBLAS alone 581 MB) on every Linux x86-64 machine; the GPU variant is
    named right below the commands."""
    text = open(README, encoding="utf-8").read()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    install = first.splitlines()[0]
    extras = set(
        re.search(r'pip install "?\.\[([^\]]*)\]', install).group(1).split(",")
    )
    pulled = _extras_closure(extras)
    assert not [r for r in pulled if "and-cuda" in r or "nvidia-" in r], pulled
    after = text[text.index("```", text.index("```bash") + 3) :][:1500]
    assert '".[demo,gpu]"' in after  # the GPU variant, right beside it
