"""Model definitions and the HF-checkpoint loader."""
from pagedserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig, read_model_config
from pagedserve.model.loader import load_model

__all__ = ["ModelConfig", "RopeConfig", "SUPPORTED_ARCHITECTURES", "load_model", "read_model_config"]
