"""The reference training loop: a SwiGLU Transformer on a real offline corpus, the spectral
optimizer family, spectral logging, sweeps and reports (``python -m spectral_ops.train``)."""

from .config import PRESETS, TrainConfig, preset
from .loop import train
from .model import ModelConfig, Transformer

__all__ = ["PRESETS", "ModelConfig", "TrainConfig", "Transformer", "preset", "train"]
