from .hf import CheckpointError, from_pretrained, load_hf_config, save_pretrained
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["CheckpointError", "Tokenizer", "TokenizerError", "from_pretrained", "load_hf_config",
           "save_pretrained"]
