"""Every former name in one table (spectral_ops/deprecations.py): each still works where it is taken, with
a warning at the user's line, and the docs show the table as it is."""

from __future__ import annotations

import pytest
import torch

import spectral_ops as so
from spectral_ops import deprecations
from spectral_ops.optim import SpectralAdamW, SpectralDecay

from generated_docs import generated_section


def test_each_rename_is_declared_once_with_the_release_that_removes_it():
    calls = [(rename.caller, rename.new, rename.old) for rename in deprecations.RENAMES]
    assert len(set(calls)) == len(calls)
    assert all(rename.removed_in == deprecations.REMOVED_IN for rename in deprecations.RENAMES)


def test_a_rename_that_is_not_declared_is_refused():
    with pytest.raises(KeyError):
        deprecations.renamed_argument("band_projectors", "sign_steps", None, "n_steps", 3)


def test_the_warnings_point_at_the_users_line():
    """Through torch.no_grad's decorator too (spectral_decay_), and from a band met inside the op."""
    W = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(DeprecationWarning, match="spectral_decay_'s weight_decay is deprecated") as record:
        so.spectral_decay_(W, 2, 0.1, weight_decay=0.1)
    with pytest.warns(DeprecationWarning, match="Band's weight_decay_bot is deprecated") as band:
        so.spectral_decay_(W, 2, 0.1, 0.1, band={"tau": 1.0, "mode": "two_band", "weight_decay_bot": 0.1})
    with pytest.warns(DeprecationWarning, match="SpectralAdamW's polar_steps is deprecated: pass decay_steps") as group:
        SpectralAdamW([{"params": [torch.nn.Parameter(W.clone())], "polar_steps": 5}])
    assert [warning.filename for warning in (*record, *band, *group)] == [__file__] * 3


def test_an_optimizers_old_keys_are_its_own():
    """``weight_decay`` is lambda_p's former name in SpectralDecay only: lambda_1 everywhere else."""
    assert [rename.old for rename in deprecations.optimizer_renames(deprecations.class_names(SpectralDecay))] == \
        ["polar_steps", "weight_decay"]
    assert [rename.old for rename in deprecations.optimizer_renames(deprecations.class_names(SpectralAdamW))] == \
        ["polar_steps"]


def test_the_docs_show_the_deprecated_names():
    assert generated_section("api.md", "spectral_ops.deprecations.markdown_table()") == deprecations.markdown_table()
