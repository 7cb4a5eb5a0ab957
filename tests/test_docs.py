"""The documentation site builds with `mkdocs build --strict`: a broken
link, a missing page or an API reference that does not resolve fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _processes import REPO_ROOT


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason='needs the "docs" extra')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for page in (
        "index.html",
        "guides/multi-worker/index.html",
        "api/callbacks/index.html",
        "changelog/index.html",
    ):
        assert (tmp_path / "site" / page).exists(), page


def test_every_guide_is_in_the_navigation():
    nav = open(os.path.join(REPO_ROOT, "mkdocs.yml")).read()
    for folder in ("guides", "api"):
        for name in os.listdir(os.path.join(REPO_ROOT, "docs", folder)):
            assert f"{folder}/{name}" in nav, name
