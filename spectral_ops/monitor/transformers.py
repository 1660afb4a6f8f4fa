"""The Hugging Face Trainer's host of :class:`~spectral_ops.monitor.SpectralMonitor`: its metrics go
through the Trainer's own ``log()``, so every ``report_to`` backend (TensorBoard, Weights & Biases, MLflow,
...) records them, next to the loss (docs/monitoring.md).

Why the callback holds the Trainer: a ``TrainerCallback`` is handed the model, the optimizer and the
Trainer's state, never the Trainer, and only ``Trainer.log`` reaches the backends (it appends to
``state.log_history``, then calls every callback's ``on_log``: the reporting integrations write there).
So :func:`monitor_trainer` builds the callback around the Trainer and adds it to it.

Imports transformers (and accelerate, the Trainer's requirement): ``import spectral_ops.monitor`` does not.
"""

from __future__ import annotations

from transformers import TrainerCallback

from .core import SpectralMonitor


def monitor_trainer(trainer, *, every: int = 50, **monitor_options) -> SpectralMonitorCallback:
    """Log ``trainer``'s spectral metrics every ``every`` optimizer steps: add a
    :class:`SpectralMonitorCallback` to it and return that callback. ``monitor_options``: the other
    keywords of :class:`SpectralMonitor` (``iterations``, ``exact``, ``include``, ...)."""
    callback = SpectralMonitorCallback(trainer, every=every, **monitor_options)
    trainer.add_callback(callback)
    return callback


class SpectralMonitorCallback(TrainerCallback):
    """Builds a :class:`SpectralMonitor` of the Trainer's model and optimizer when ``train()`` begins (the
    Trainer creates its optimizer there), logs its metrics through ``trainer.log`` at step 0 of a new run
    (the initial weights) and at every ``state.global_step`` that is a multiple of ``every`` (the weights
    after that many optimizer steps; a Trainer logs its loss at the same step), and closes it when training
    ends. A resumed run starts counting the decays again (``decay.*.decays``: steps since this ``train()``).

    Add it with :func:`monitor_trainer`, or ``trainer.add_callback(SpectralMonitorCallback(trainer, ...))``
    to the Trainer it holds (a callback added to another Trainer raises when training begins).
    """

    def __init__(self, trainer, *, every: int = 50, **monitor_options):
        # The options are checked now, on the model without its optimizer (nothing is registered on
        # anything), so that a wrong one raises here rather than once train() has prepared everything.
        SpectralMonitor(trainer.model, every=every, **monitor_options)
        self.trainer, self.every, self.monitor_options = trainer, every, monitor_options
        self.monitor: SpectralMonitor | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self not in self.trainer.callback_handler.callbacks:
            raise ValueError("this SpectralMonitorCallback was added to a Trainer other than the one it logs "
                             "through; add it with spectral_ops.monitor.transformers.monitor_trainer(trainer)")
        if self.monitor is not None:  # an earlier train() of the same Trainer
            self.monitor.close()
        self.monitor = SpectralMonitor(model, _unwrapped(optimizer), every=self.every, **self.monitor_options)
        if state.global_step == 0:
            return self._log(control)
        return None

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor.due(state.global_step):
            return self._log(control)
        return None

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.close()

    def _log(self, control):
        # Trainer.log ends in the handler's on_log, which clears control.should_log: at a step where the
        # Trainer is about to log its loss (DefaultFlowCallback set it), that log would be lost.
        should_log = control.should_log
        self.trainer.log(self.monitor.compute())
        control.should_log = should_log
        return control


def _unwrapped(optimizer):
    """The torch optimizer inside accelerate's wrapper: the Trainer steps the wrapper, whose ``step`` calls
    the inner optimizer's, and only that one runs step hooks (the monitor's count of decay steps)."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
