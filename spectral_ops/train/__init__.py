"""The reference training loop: a SwiGLU Transformer on a real offline corpus, the spectral
optimizer family, spectral logging, sweeps and reports (``python -m spectral_ops.train``).

The top layer (README, "Architecture"), with the experiments, the metrics and the analysis: it may import
any layer of the package, and nothing of the package imports it but ``spectral_ops.experiments``."""

from .config import PRESETS, TrainConfig, preset
from .loop import train
from .model import ModelConfig, Transformer

__all__ = ["PRESETS", "ModelConfig", "TrainConfig", "Transformer", "preset", "train"]
