"""Every public op that reads a weight's matrices, called once with fixed arguments (shared by the tests of
the N-D rule and of the autograd contract)."""

import spectral_ops as so

# Every op that reads a weight's matrices, each returning a tensor (band_projectors: its top projector;
# spectral_norm_bounds: its upper bound). Factorised routes where they exist keep the module fast.
OPS = {
    "polar": lambda W, **kw: so.polar(W, **kw),
    "spectral_power": lambda W, **kw: so.spectral_power(W, 2, **kw),
    "power_update": lambda W, **kw: so.power_update(W, 0.25, **kw),
    "spectral_clip": lambda W, **kw: so.spectral_clip(W, max=0.05, method="svd", **kw),
    "svt": lambda W, **kw: so.svt(W, 0.02, method="svd", **kw),
    "band_direction": lambda W, **kw: so.band_direction(W, 0.05, 2, "top", method="svd", **kw),
    "band_projectors": lambda W, **kw: so.band_projectors(W, 0.05, method="svd", **kw)[0],
    "spectral_norm_bounds": lambda W, **kw: so.spectral_norm_bounds(W, **kw)[1],
    "spectral_decay": lambda W, **kw: so.spectral_decay(W, 2, 0.02, 0.5, **kw),
    "spectral_decay_": lambda W, **kw: so.spectral_decay_(W.clone(), 2, 0.02, 0.5, **kw),
}
# Those whose result is a weight-shaped tensor (the others' is per matrix of the reading).
SAME_SHAPE = {"polar", "spectral_power", "power_update", "spectral_clip", "svt", "band_direction", "spectral_decay",
              "spectral_decay_"}
