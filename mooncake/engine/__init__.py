"""The engine: model loading, own forward (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) over a paged KV cache, sampling.

Not thread-safe; see ``Engine``.
"""

from mooncake.engine.engine import Engine
from mooncake.engine.errors import InvalidRequestError, ModelLoadError
from mooncake.engine.loading.loader import LoadedModel, default_model_path, load_model
from mooncake.engine.sequence import PrefillStep, Sequence, StepOutput

__all__ = ["load_model", "LoadedModel", "Engine", "Sequence", "PrefillStep", "StepOutput",
           "ModelLoadError", "InvalidRequestError", "default_model_path"]
