"""pagedserve: an LLM inference server built around a paged KV-cache pool."""
from pagedserve.config import EngineConfig
from pagedserve.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name):  # torch is imported only when the engine is actually used
    if name in ("LLM", "Engine"):
        from pagedserve import engine
        return getattr(engine, name)
    raise AttributeError(name)
