"""The CPU plugin's surface (:mod:`polopt_lightning.accel`): the module's training levers (:class:`.fast_path.
CPUFastPath`), the transformers backend's decoding levers (:class:`.decode.CPUDecoding`) and a loaded model's weights
out of their mapped files (:func:`.weights.release_weight_files`), the product for a backward pass
(:func:`.linear.backward_product`) and activation checkpointing's contexts (:func:`.linear.recompute_contexts`)."""

from .decode import CPUDecoding
from .fast_path import CPUFastPath
from .linear import backward_product, recompute_contexts
from .weights import release_weight_files

training = CPUFastPath.of
decoding = CPUDecoding.of
loaded = release_weight_files

__all__ = ["CPUDecoding", "CPUFastPath", "backward_product", "decoding", "loaded", "recompute_contexts", "training"]
