"""The algorithm, written once: every op as a sequence of primitive calls (SPEC 1.2-1.5).

The package reads top to bottom, each module using only those above it:

* :mod:`.iterations`: the polynomial iterations (Polar Express on the rectangle and in Gram space, the
  matrix sign, ``G^k`` by repeated squaring, the real powers' inverse root) and which coefficients a
  polar factor iterates;
* :mod:`.thresholds`: where a band form splits the spectrum (:func:`threshold_design`) and the six band
  modes as one table of what goes on each side (:data:`BAND_SIDES`), with the forms built from it;
* :mod:`.gram`: the Gram forms, :class:`GramPlan` (``X``, its Gram and squares, the polar factor,
  ``S_p``, the guard's bound on ``s_max``);
* :mod:`.factorised`: the same forms from an SVD or eigendecomposition, :class:`FactorisedPlan`;
* :mod:`.routing`: every choice of algorithm (:func:`route`, once per op call, passed down) and the ops;
* :mod:`.decay`: the decay of one stack (:func:`decay_`): the guard, the direction and the write;
* :mod:`.costs`: what each op and the decay cost (:func:`cost`, :func:`work`: the FLOPs, bytes and
  launches read off this very plan on meta tensors). Routing weighs the same counts
  (:func:`~spectral_ops.backends.counting.counted`) without importing it: the decay that the cost
  model counts runs the ops that route.

**Precision** (:func:`~spectral_ops.precision.resolve_precision`) decides the dtype of the iteration's
operands: every product takes them in that dtype, accumulates in fp32 (fp64 for ``"fp64"``) and rounds
its result to it, as torch.optim.Muon's bf16 iteration does. The normalisation, the scale ``c^p``, the
band thresholds and the decay arithmetic stay in the compute dtype (fp64 for fp64 weights or
``"fp64"``, fp32 otherwise), and the result is rounded to the weight's dtype once.

The plan layer (README, "Architecture") sits below the API and above dispatch: it takes ``kernels`` from
its caller and never imports dispatch, the API or anything above. What dispatch needs of the plan (the
composition of a small chain) is handed to it by :mod:`spectral_ops.ops`.

Every name is importable from ``spectral_ops.plan`` as before the split (pickles name
``spectral_ops.plan.Band`` and the like).
"""

# ruff: noqa: F401  (the re-exports are the package's names)

from ..precision import FLOAT32_MATMUL_PRECISIONS, OPERAND_DTYPES, PRECISIONS, clip_precision, resolve_precision
from .costs import cost, work
from .decay import (
                         CLAMP_ORDER,
                         ROUNDINGS,
                         STABILITY_POLICIES,
                         STOCHASTICALLY_ROUNDED,
                         DecayOutcome,
                         DecayRequest,
                         SpectralStabilityError,
                         decay_,
                         decay_polar_coefficients,
                         is_prox,
                         is_zero,
                         log_clamp,
                         logger,
                         needs_direction,
                         plain_factor,
                         rounding_noise,
                         scaled_step,
                         settled_by_the_norm,
                         stability_clamp,
                         stability_kappa,
                         stability_terms,
)
from .factorised import FactorisedPlan
from .gram import (
                         ESTIMATE_SQUARINGS,
                         GUARD_SQUARINGS,
                         NORM_ROUNDING,
                         RELATIVE_ROUNDING_CAP,
                         ROUNDING,
                         GramPlan,
                         chained_power,
                         checked_finite,
                         renormalized,
)
from .iterations import (
                         DEVICE_DESIGN_TOLERANCE,
                         GRAM_SPACE_BLOCK,
                         GRAM_SPACE_PRECISIONS,
                         GRAM_SPACE_SAVING,
                         ITERATIONS,
                         POLYNOMIALS,
                         REAL_POWER_TOLERANCE,
                         RESOLUTION,
                         ROOT_LOWER,
                         ROOT_ORDER,
                         TENSOR_POWER_BOUND,
                         coupled_inverse_root,
                         design_widening,
                         floor_lifts,
                         function_polynomial,
                         inverse_root,
                         matrix_power_of_root,
                         matrix_sign,
                         orthogonalization_coefficients,
                         polar_coefficients,
                         polar_iterations,
                         repeated_squaring,
                         restart_blocks,
                         root_squarings,
                         symmetric_polynomial,
                         update_coefficients,
)
from .routing import (
                         CHAIN_POWER_RANGE_BITS,
                         EIGH_PRODUCTS,
                         FACTORISATIONS,
                         METHODS,
                         OPS,
                         QK_CAP_SQUARINGS,
                         UPDATE_FLOOR,
                         UPDATE_SCALES,
                         USEFUL_SQUARINGS,
                         QKCapOutcome,
                         Route,
                         band_direction,
                         band_projectors,
                         beyond_tensor_power_nan,
                         composed_chain,
                         lifting,
                         msign,
                         plan_for,
                         polar,
                         polar_factor,
                         power_update,
                         qk_cap,
                         route,
                         routed,
                         spectral_clip,
                         spectral_norm_bounds,
                         spectral_power,
                         svt,
)
from .thresholds import (
                         BAND_MODES,
                         BAND_SIDES,
                         CAPTURABLE_DEPTH,
                         CUTOFF_ESTIMATE_MARGIN,
                         CUTOFF_RESOLUTION,
                         CUTOFF_TOLERANCE_UNITS,
                         DEFAULT_LOWER,
                         DEFAULT_STEPS,
                         GRAM_RESOLVES,
                         THRESHOLD_RESOLUTION,
                         THRESHOLD_TOLERANCE,
                         Band,
                         FactorisedThresholds,
                         GramThresholds,
                         LiftDesign,
                         Scale,
                         Term,
                         ThresholdDesign,
                         lift_design,
                         per_mode,
                         spectral_terms,
                         term_power,
                         threshold_design,
                         weighs_its_bands,
)
