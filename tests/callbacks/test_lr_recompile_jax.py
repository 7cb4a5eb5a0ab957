"""JAX: a new LR callback in a later `fit` reuses the compiled train
step and runs its own numbers. Body shared with the TensorFlow module:
`lr_recompile_bodies.py`."""

from __future__ import annotations

import pytest
from callbacks.lr_recompile_bodies import (
    CASES,
    check_no_recompile,
    check_resume_with_backup,
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_later_fit_with_new_callbacks_does_not_recompile(case):
    check_no_recompile(case)


@pytest.mark.parametrize("backup_first", [True, False])
def test_resume_with_backup_and_restore(tmp_path, backup_first):
    check_resume_with_backup(tmp_path, backup_first)
