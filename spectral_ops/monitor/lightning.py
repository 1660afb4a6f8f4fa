"""Lightning's host of :class:`~spectral_ops.monitor.SpectralMonitor`: a ``Callback`` whose metrics go to
every logger of the Trainer (TensorBoard, CSV, Weights & Biases, MLflow, ...) and into
``trainer.callback_metrics`` (docs/monitoring.md).

Why it writes to the loggers itself rather than through ``log_dict``'s logger path: a value logged with
``self.log(on_step=True)`` stays in Lightning's results and is written again at every later logging step
until it is logged anew, so a metric computed every ``every`` steps would show stale copies in between
(with ``log_every_n_steps=1``, at every step), and it is written at Lightning's step for the batch, one
below ``trainer.global_step``, only where ``log_every_n_steps`` divides it. So, as Lightning's own
``LearningRateMonitor`` does, the callback calls each logger's ``log_metrics`` with the step; ``log_dict``
(``logger=False``) still hands the values to the callbacks that read ``trainer.callback_metrics``
(``EarlyStopping``, ``ModelCheckpoint(monitor=...)``).

Imports lightning: ``import spectral_ops.monitor`` does not.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from .core import SpectralMonitor


class SpectralMonitorCallback(Callback):
    """Builds a :class:`SpectralMonitor` of the LightningModule and the Trainer's optimizers when training
    starts (after ``configure_optimizers``), logs its metrics at step 0 of a new run (the initial weights)
    and whenever ``trainer.global_step`` (the optimizer steps taken) reaches a multiple of ``every``, at that
    step, and closes it when training ends. ``monitor_options``: the other keywords of
    :class:`SpectralMonitor` (``iterations``, ``exact``, ``include``, ...).

    At step ``N`` the metrics describe the weights after ``N`` optimizer steps, which the batch Lightning
    logs at the same step was computed on.
    """

    def __init__(self, every: int = 50, **monitor_options):
        self.every, self.monitor_options = every, monitor_options
        self.monitor: SpectralMonitor | None = None
        self._logged_step = None

    def on_train_start(self, trainer, pl_module):
        if self.monitor is not None:  # an earlier fit() of the same callback
            self.monitor.close()
        optimizers = trainer.optimizers[0] if len(trainer.optimizers) == 1 else trainer.optimizers
        self.monitor = SpectralMonitor(pl_module, optimizers, every=self.every, **self.monitor_options)
        self._logged_step = None
        if trainer.global_step == 0:
            self._log_to_loggers(trainer, self.monitor.compute())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Under gradient accumulation the batches between two optimizer steps end at the same global step:
        # the first of them to end there is the one that stepped.
        step = trainer.global_step
        if step == self._logged_step or not self.monitor.due(step):
            return
        metrics = self.monitor.compute()
        self._log_to_loggers(trainer, metrics)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=False)

    def on_train_end(self, trainer, pl_module):
        self.monitor.close()

    def _log_to_loggers(self, trainer, metrics: dict) -> None:
        self._logged_step = trainer.global_step
        for logger in trainer.loggers:  # each writes on global rank 0 only
            logger.log_metrics(metrics, step=trainer.global_step)
