"""The CPU plugin's surface (:mod:`polopt_lightning.accel`): the module's training levers (:class:`.fast_path.
CPUFastPath`), the transformers backend's decoding levers (:class:`.decode.CPUDecoding`) and a loaded model's weights
out of their mapped files (:func:`.weights.release_weight_files`)."""

from .decode import CPUDecoding
from .fast_path import CPUFastPath
from .weights import release_weight_files

training = CPUFastPath.of
decoding = CPUDecoding.of
loaded = release_weight_files

__all__ = ["CPUDecoding", "CPUFastPath", "decoding", "loaded", "training"]
