"""Model definitions and the HF-checkpoint loader."""
from pagedserve.model.loader import ModelConfig, SUPPORTED_ARCHITECTURES, load_model, read_model_config

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "load_model", "read_model_config"]
