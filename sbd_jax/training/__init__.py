"""SBD fine-tuning: examples (`[x ; x_hat]`), dual loss, sharded train step, data, checkpoints, loop."""
from .config import CheckpointConfig, DataConfig, ModelSource, OptimConfig, SBDConfig, TrainConfig
from .examples import Example, PackedBatch, build_ntp_example, build_sbd_example, make_example
from .loss import sbd_loss
from .spec import ExampleSpec, StepOptions
from .step import TrainState, jit_train_step, make_train_step

__all__ = ["CheckpointConfig", "DataConfig", "Example", "ExampleSpec", "ModelSource", "OptimConfig", "PackedBatch",
           "SBDConfig", "StepOptions", "TrainConfig", "TrainState", "build_ntp_example", "build_sbd_example",
           "jit_train_step", "make_example", "make_train_step", "sbd_loss", "train"]


def train(*args, **kwargs):
    """`sbd_jax.training.loop.train` (imported lazily: it pulls in orbax and datasets)."""
    from .loop import train as _train
    return _train(*args, **kwargs)
