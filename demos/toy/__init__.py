"""The built-in demo (`make demo`)."""
