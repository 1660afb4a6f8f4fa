"""The spectral-decay optimizer family (``torch.optim.Optimizer`` subclasses).

=================  ============================================================
``SpectralAdamW``  AdamW + ``lambda_1 W + lambda_p S_p(W)``
``SpectralMuon``   Muon (Polar Express or torch's quintic; head-wise/full Q/K/V)
                   + decay, with an internal AdamW for non-matrix parameters
``SpectralSGD``    SGD with momentum + decoupled decay
``SpectralDecay``  the decay alone, for any optimizer (``.attach(optimizer)``)
``QKCap``          the spectral QK cap after each step of any optimizer
=================  ============================================================

The optimizers layer (README, "Architecture"): below training and the experiments, above the API. What an
optimizer needs of a weight's matrices or of the decay comes from the API (:mod:`spectral_ops.decay`,
:mod:`spectral_ops.matrix_views`) and the plan; what does not need an optimizer (a module's reading of its
parameters, ``matrix_view_of``, re-exported here) lives there, so that the layers below can use it too.
"""

from ..matrix_views import matrix_view_of
from .adamw import SpectralAdamW
from .groups import (
    full_v_extra_decay,
    module_wise_powers,
    param_groups_by_module,
    parameter_role,
    width_scaled_hyperparameters,
    width_transfer,
)
from .hook import SpectralDecay
from .muon import SpectralMuon
from .qk_cap import QKCap
from .sgd import SpectralSGD

__all__ = [
    "QKCap",
    "SpectralAdamW",
    "SpectralDecay",
    "SpectralMuon",
    "SpectralSGD",
    "full_v_extra_decay",
    "matrix_view_of",
    "module_wise_powers",
    "param_groups_by_module",
    "parameter_role",
    "width_scaled_hyperparameters",
    "width_transfer",
]
