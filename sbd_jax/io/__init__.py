from .hf import CheckpointError, from_pretrained, hf_state_dict, load_hf_config, save_pretrained

__all__ = ["CheckpointError", "from_pretrained", "hf_state_dict", "load_hf_config", "save_pretrained"]
