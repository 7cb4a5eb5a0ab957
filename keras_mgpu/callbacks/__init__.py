"""Keras callbacks: learning-rate warmup/scaling and resource monitors."""

from keras_mgpu.callbacks.backup_and_restore import BackupAndRestore
from keras_mgpu.callbacks.gpu_load_monitor import GPULoadMonitor
from keras_mgpu.callbacks.learning_rate_scaler import LearningRateScaler
from keras_mgpu.callbacks.learning_rate_warmup import LearningRateWarmup
from keras_mgpu.callbacks.memory_monitor import MemoryMonitor
from keras_mgpu.callbacks.pruning_step_sync import PruningStepSync
from keras_mgpu.callbacks.straggler_monitor import StragglerMonitor
from keras_mgpu.callbacks.throughput_monitor import ThroughputMonitor
from keras_mgpu.callbacks.worker_watchdog import WorkerWatchdog

__all__ = [
    "BackupAndRestore",
    "GPULoadMonitor",
    "LearningRateScaler",
    "LearningRateWarmup",
    "MemoryMonitor",
    "PruningStepSync",
    "StragglerMonitor",
    "ThroughputMonitor",
    "WorkerWatchdog",
]
