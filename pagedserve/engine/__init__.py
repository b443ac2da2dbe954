"""The front-ends around the engine core: Engine (synchronous), LLM (offline generation),
AsyncLLM (the server's), with the input and output processing they share."""
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import Engine, default_model_dir

__all__ = ["LLM", "Engine", "default_model_dir"]
