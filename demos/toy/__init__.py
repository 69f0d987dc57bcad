"""The toy demo (`make demo-toy`): the paper's Table 1 in miniature."""
