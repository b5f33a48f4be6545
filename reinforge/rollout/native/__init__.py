"""reinforge's native rollout engine: paged KV cache, prefix caching, continuous batching, CUDA graphs.

Modules, one job each: ``sequence`` (one sample's state), ``block_manager`` (KV blocks,
their reference counts and the prefix cache), ``scheduler`` (which sequences run each step, also
the steps launched ahead of one in flight), ``model`` (the decoder forward, from the architecture table),
``layers`` (its attention and MLP blocks, chosen per layer), ``rotary_tables`` (each rope kind's cos/sin),
``attention`` and ``triton_kernels`` (the kernels), ``model_runner`` (cache, step inputs, CUDA
graphs), ``sampling``, ``engine`` (the entry points, each step's schedule, run and read-back)
and ``async_driver`` (``generate_async``: requests from an event loop, steps in a worker thread).
"""

from reinforge.rollout.native.engine import NativeEngine
from reinforge.rollout.native.model import hf_fallback_notice, supports_model, unsupported_reason

__all__ = ["NativeEngine", "hf_fallback_notice", "supports_model", "unsupported_reason"]
