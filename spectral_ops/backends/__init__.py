"""Backends: one module each. ``spectral_ops.dispatch`` is the only place that chooses between them."""
