"""Backends: one module each. ``spectral_ops.dispatch`` is the only place that chooses between them.

The backends layer (README, "Architecture"): the primitives and what a primitive call costs
(:mod:`.counting`), below dispatch and the plan, which both use them and neither of which a backend
imports. A function that runs primitives on kernels without choosing an algorithm (counting a call on
meta tensors, :func:`.counting.counted`) lives here, so that the plan and the cost model of dispatch
can share it.
"""
