"""Self-distillation data: a model's own greedy continuations as training records of token ids.

Lossless (verify) decoding keeps a draft only when it equals the model's own AR token, so the best targets for the
copy stream are that model's greedy tokens: a deterministic, low-entropy function of the prefix, far easier to
learn than human text. The continuations come from the project's batch decoder (`decode.py --mode ar`, greedy,
resumable, its settings in `<output>.settings.json`); `join` pairs them with their prompts as
{"id", "prompt_ids", "response_ids"} lines, which the SFT data pipeline reads as they are (no re-tokenization: the
ids are exactly what the model produced).

    python decode.py --model M --input prompts.jsonl --output greedy.jsonl --mode ar --max-new-tokens 128
    python -m sbd_jax.training.distill prompts.jsonl greedy.jsonl distilled.jsonl

then train with data.path=distilled.jsonl data.prompt_field=prompt_ids data.response_field=response_ids.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..config import ConfigError
from ..jsonlines import read_object


def id_records(pairs: list) -> dict:
    """The data pipeline's `map` output for pre-tokenized (prompt ids, response ids) records, used as they are
    (nothing appended): {"input_ids", "n_prompt", "status"} (status: store.RECORD_DROPS)."""
    ok = [all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in p) and bool(p[1]) for p in pairs]
    return {"input_ids": [p[0] + p[1] if k else [] for p, k in zip(pairs, ok)],
            "n_prompt": [len(p[0]) if k else 0 for p, k in zip(pairs, ok)],
            "status": [0 if k else 1 if not all(isinstance(x, list) for x in p) else 2 for p, k in zip(pairs, ok)]}


def _rows(path: Path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{str(path)!r} line {n}: not JSON ({e.msg})") from None


def check_greedy(decoded: Path) -> dict:
    """The decoder's settings record of `decoded`, refused unless the run was AR and greedy."""
    settings_file = decoded.with_name(decoded.name + ".settings.json")
    if not settings_file.is_file():
        raise ConfigError(f"{str(settings_file)!r} is missing: `decoded` must be a decode.py output (its settings "
                          "record says how the continuations were made)")
    settings = read_object(settings_file, ConfigError)
    spec = settings.get("spec", {})
    if spec.get("mode") != "ar" or settings.get("temperature") != 0.0 or spec.get("verify"):
        raise ConfigError(f"{str(decoded)!r} was decoded with mode={spec.get('mode')!r}, temperature="
                          f"{settings.get('temperature')!r}: self-distillation data is the model's greedy AR output "
                          "(decode.py --mode ar --temperature 0)")
    return settings


def join(prompts: str | os.PathLike, decoded: str | os.PathLike, out: str | os.PathLike) -> int:
    """Write {"id", "prompt_ids", "response_ids"} for every decoded row (the decoder's order), its prompt's ids from
    `prompts` ({"id", "prompt_ids"} lines) -> the number of records. A decoded id without its prompt, or a prompt
    without ids, is an error naming file and line."""
    prompts, decoded, out = Path(prompts), Path(decoded), Path(out)
    settings = check_greedy(decoded)
    by_id = {}
    for n, r in _rows(prompts):
        ids = r.get("prompt_ids") if isinstance(r, dict) else None
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            raise ConfigError(f"{str(prompts)!r} line {n}: needs \"prompt_ids\", a non-empty list of token ids")
        by_id[str(r.get("id"))] = ids
    tmp = out.with_name(f".{out.name}.tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for n, r in _rows(decoded):
            pid = str(r.get("id"))
            if pid not in by_id:
                raise ConfigError(f"{str(decoded)!r} line {n}: id {pid!r} is not in {str(prompts)!r}")
            if not r.get("tokens"):
                continue  # a row that produced nothing has nothing to teach
            f.write(json.dumps({"id": pid, "prompt_ids": by_id[pid], "response_ids": r["tokens"]}) + "\n")
            count += 1
    tmp.replace(out)
    meta = {"prompts": str(prompts), "decoded": str(decoded), "records": count, "model": settings.get("model"),
            "max_new_tokens": settings.get("spec", {}).get("max_new_tokens")}
    out.with_name(out.name + ".source.json").write_text(json.dumps(meta, indent=2) + "\n")
    return count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", help="the prompts decode.py read ({\"id\", \"prompt_ids\"} lines)")
    ap.add_argument("decoded", help="decode.py's output for them (--mode ar, greedy)")
    ap.add_argument("out", help="the training records to write")
    args = ap.parse_args(argv)
    try:
        n = join(args.prompts, args.decoded, args.out)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{n} records -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
