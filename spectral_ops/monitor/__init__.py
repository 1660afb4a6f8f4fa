"""Spectral monitoring (docs/monitoring.md): :class:`SpectralMonitor` computes a model's spectral metrics as
flat scalars, cheaply (a warm-started power iteration per matrix, no SVD); the hosts log them where users
read metrics: a Hugging Face ``TrainerCallback`` (:mod:`.transformers`), a Lightning ``Callback``
(:mod:`.lightning`), and TensorBoard event files and CSV for a plain loop (:mod:`.writer`).

The training layer (README, "Architecture"): it reads the optimizers' counts and the attention pairs
of the API layer; nothing below imports it.
"""

from .core import MATRIX_METRICS, SpectralMonitor, decay_counts
from .power import power_iterations
from .writer import MetricsWriter

__all__ = ["MATRIX_METRICS", "MetricsWriter", "SpectralMonitor", "decay_counts", "power_iterations"]
