"""HF side of bench/bench_real_ar.py, run in the reference venv (.venv-ref: torch CPU + transformers):

    python hf_generate_ref.py MODEL_DIR PROMPTS.npy NEW REPS OUT.json

Greedy `generate` of exactly NEW tokens per row (EOS ignored), default cache, float32, all cores; median of REPS
runs after a warm-up -> {"seconds", "tokens_per_s", "tokens"}."""
import json
import statistics
import sys
import time

import numpy as np
import torch
import transformers


def main(model_dir, prompts_path, new, reps, out_path):
    new, reps = int(new), int(reps)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.load(prompts_path).astype(np.int64))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **kw)  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    json.dump({"seconds": s, "tokens_per_s": ids.shape[0] * new / s, "torch_threads": torch.get_num_threads(),
               "tokens": out[:, ids.shape[1]:].tolist()}, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
