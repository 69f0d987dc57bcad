"""sbd_jax: Set Block Decoding (Gat et al. 2025) in pure JAX."""
from .config import ConfigError
from .models.config import ModelConfig, RopeScaling
from .io import CheckpointError, from_pretrained, save_pretrained
from .decoding import generate
from .models import KVCache, forward, init_cache, init_params

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "KVCache", "ModelConfig", "RopeScaling", "forward",
           "from_pretrained", "generate", "init_cache", "init_params", "save_pretrained"]
