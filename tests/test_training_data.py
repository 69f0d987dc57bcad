"""Training data: local files through `datasets`, a local tokenizer.json (+ chat template), packing
into rows with segment ids, deterministic order, resumable iterator state, clear errors."""
import json

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from sbd_jax.config import ConfigError
from sbd_jax.io.tokenizer import Tokenizer, TokenizerError
from sbd_jax.training.config import DataConfig
from sbd_jax.training.data import DataError, Documents, PackedIterator, build_iterator
from sbd_jax.training.shuffle import Permutation
from sbd_jax.training.store import FileArray

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "big", "red", "sun", "hello", "world",
         "answer", "is", "yes", "no"]
SPECIALS = ["<pad>", "<s>", "</s>", "<m>", "<unk>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{{ bos_token }} {% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tk = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = WhitespaceSplit()
    tk.add_special_tokens(SPECIALS)
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    return d


def ids(words):
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    return [vocab[w] for w in words.split()]


TEXTS = ["the cat sat on a mat", "dog ran far away", "big red sun", "hello world", "the dog sat",
         "a cat ran on the big red mat far away", "yes", "no no no"]


def _check_rows(batch, L):
    """Structural invariants of packed rows: contiguous segments 1..n, positions restart at 0."""
    for t, s, p, lm in zip(*batch):
        assert len(t) == L
        n = s.max()
        real = s > 0
        assert (np.diff(s[real]) >= 0).all() and set(s[real]) == set(range(1, n + 1))
        assert not real[np.argmin(real):].any() if not real.all() else True  # padding only at the end
        for seg in range(1, n + 1):
            np.testing.assert_array_equal(p[s == seg], np.arange((s == seg).sum()))
        assert (lm[~real] == 0).all() and (t[~real] == 0).all()


# ---------------------------------------------------------------------------------------------- packing


def test_packing_hand_built():
    A, B, C, D, E = [1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11], list(range(12, 20))
    F, G = [30, 31, 32, 33, 34, 35, 36, 37], [40] * 7
    docs = Documents.from_lists([A, B, C, D, E, F, G], n_prompt=[0, 0, 0, 0, 0, 3, 6])
    it = PackedIterator(docs, seq_len=6, batch_size=1, shuffle=False)
    rows = [it.next_batch() for _ in range(7)]
    tok = [r.tokens[0].tolist() for r in rows]
    assert tok[0] == [1, 2, 3, 0, 0, 0]  # B does not fit the rest of the row: it starts the next
    assert tok[1] == [4, 5, 6, 7, 8, 0]
    assert tok[2] == [9, 10, 0, 0, 0, 0]  # D (1 token) dropped; E's first piece does not fit
    assert tok[3] == [12, 13, 14, 15, 16, 17]  # E is cut into L-token pieces
    assert tok[4] == [18, 19, 0, 0, 0, 0]  # F (prompt/response) does not fit after E's tail
    assert tok[5] == [30, 31, 32, 33, 34, 35]  # F truncated to L; G (prompt >= L) dropped; next epoch: A
    assert tok[6] == [1, 2, 3, 0, 0, 0]
    np.testing.assert_array_equal(rows[5].loss_mask[0], [0, 0, 0, 1, 1, 1])  # prompt tokens not counted
    np.testing.assert_array_equal(rows[4].segment[0], [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows[4].position[0], [0, 1, 0, 0, 0, 0])
    assert it.epoch() == 1
    np.testing.assert_array_equal(rows[1].loss_mask[0], [1, 1, 1, 1, 1, 0])


def test_packing_with_a_copy_stream_budget():
    """copy_len C: a row closes when the next piece's copy-stream tokens (from its response start on) would
    exceed C; longer responses are cut to C tokens, text pieces to C tokens; state records C."""
    A = [1, 2, 3, 4, 5]          # prompt 3, response 2
    B = [6, 7, 8, 9, 10, 11]     # prompt 2, response 4
    T = list(range(12, 19))      # text, 7 tokens
    F = [20, 21, 22, 23, 24, 25, 26, 27]  # prompt 1, response 7 -> cut to 1 + C
    docs = Documents.from_lists([A, B, T, F], n_prompt=[3, 2, 0, 1])
    it = PackedIterator(docs, seq_len=12, batch_size=1, shuffle=False, copy_len=5)
    rows = [it.next_batch() for _ in range(6)]
    tok = [r.tokens[0].tolist() for r in rows]
    assert tok[0] == [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0]  # 11 tokens would fit L, but 2 + 4 copy tokens > 5
    assert tok[1] == [6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0]  # the text piece (5 copy tokens) does not fit after
    assert tok[2] == [12, 13, 14, 15, 16, 0, 0, 0, 0, 0, 0, 0]  # text cut into C-token pieces
    assert tok[3] == [17, 18, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # 2 + F's 5 copy tokens > 5
    assert tok[4] == [20, 21, 22, 23, 24, 25, 0, 0, 0, 0, 0, 0]  # F's response cut to C = 5 tokens
    np.testing.assert_array_equal(rows[4].loss_mask[0][:6], [0, 1, 1, 1, 1, 1])
    assert tok[5] == tok[0]  # next epoch
    assert it.state()["copy_len"] == 5
    with pytest.raises(DataError, match="copy_len"):
        PackedIterator(docs, 12, 1, shuffle=False).restore(it.state())
    with pytest.raises(ConfigError, match="copy_len must be in"):
        DataConfig(seq_len=12, copy_len=13)
    # C = L: the same rows as without a budget
    plain, same = PackedIterator(docs, 12, 2, seed=4), PackedIterator(docs, 12, 2, seed=4, copy_len=12)
    for _ in range(6):
        np.testing.assert_array_equal(plain.next_batch().tokens, same.next_batch().tokens)


def test_packing_multiple_docs_per_row_and_epoch_coverage():
    """Row r packs the documents at positions r, r + B, ... of each epoch's order: over the rows, every document
    exactly once per epoch."""
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(5, 50, rng.integers(2, 9))) for _ in range(40)]
    B = 4
    it = PackedIterator(Documents.from_lists(docs), seq_len=16, batch_size=B, seed=3)
    seen = [[] for _ in range(B)]
    while it.epoch() == 0:
        b = it.next_batch()
        _check_rows(b, 16)
        for r, (t, s) in enumerate(zip(b.tokens, b.segment)):
            seen[r] += [t[s == k].tolist() for k in range(1, s.max() + 1)]
    epoch0 = [d for r in range(B) for d in seen[r][:len(range(r, 40, B))]]  # rows may run into the next epoch
    assert sorted(map(tuple, epoch0)) == sorted(map(tuple, docs))
    assert [d for r in range(B) for d in seen[r][:2]] != [docs[i] for i in range(2 * B)]  # shuffled


def test_permutation_is_a_bijection_in_constant_memory():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        p = Permutation(n, 5, 0, 1)
        out = [p(i) for i in range(n)]
        assert sorted(out) == list(range(n))
    a, b = Permutation(1000, 5, 0, 1), Permutation(1000, 5, 0, 2)
    assert [a(i) for i in range(20)] != [b(i) for i in range(20)]  # another epoch, another order
    assert [a(i) for i in range(20)] == [Permutation(1000, 5, 0, 1)(i) for i in range(20)]
    assert sum(a(i) == i for i in range(1000)) < 20  # not near the identity
    with pytest.raises(IndexError):
        a(1000)


def test_rows_split_over_processes_pack_the_same_rows():
    """Any split of the batch rows over iterators (processes) packs exactly the rows one iterator packs, each
    state restores its own rows, and the merged state restores any split."""
    rng = np.random.default_rng(1)
    docs = Documents.from_lists([list(rng.integers(5, 50, rng.integers(2, 12))) for _ in range(57)])
    one = PackedIterator(docs, 16, 6, seed=2)
    parts = [PackedIterator(docs, 16, 6, seed=2, rows=r) for r in ([0, 3, 4], [5, 1], [2])]
    for _ in range(5):
        full = one.next_batch()
        for part in parts:
            got = part.next_batch()
            for x, y in zip(full, got):
                np.testing.assert_array_equal(x[list(part.rows)], y)
    merged = {**one.state(), "streams": {k: v for p in parts for k, v in p.state()["streams"].items()}}
    assert merged["streams"] == one.state()["streams"]
    expected = [one.next_batch() for _ in range(4)]
    again = PackedIterator(docs, 16, 6, seed=2, rows=[1, 2, 4])  # another split, restored from the merged state
    again.restore(json.loads(json.dumps(merged)))
    for e in expected:
        for x, y in zip(e, again.next_batch()):
            np.testing.assert_array_equal(x[[1, 2, 4]], y)
    with pytest.raises(DataError, match="rows must be distinct batch rows|must be distinct"):
        PackedIterator(docs, 16, 6, rows=[6])
    with pytest.raises(DataError, match=r"no position for rows \[2\]"):
        PackedIterator(docs, 16, 6, seed=2, rows=[2]).restore(parts[0].state())


def test_sources_mixed_by_weights():
    """Two sources, weights 3:1: each row draws documents in those shares (within one), each source keeps its own
    epochs (every document of the small source once per its epoch), and the state restores the mix."""
    big = Documents.from_lists([[10 + i % 30] * 3 for i in range(200)])
    small = Documents.from_lists([[100 + i] * 2 for i in range(12)])
    B = 2
    it = PackedIterator([big, small], 8, B, weights=[3, 1], seed=0)
    seen = [[] for _ in range(B)]
    for _ in range(30):
        b = it.next_batch()
        for r, (t, s) in enumerate(zip(b.tokens, b.segment)):
            seen[r] += [t[s == k][0] for k in range(1, s.max() + 1)]
    for row in seen:
        n_small = sum(v >= 100 for v in row)
        assert abs(n_small - len(row) / 4) <= 1, (n_small, len(row))
    first_epoch = [v for r in range(B) for v in [v for v in seen[r] if v >= 100][:len(range(r, 12, B))]]
    assert sorted(first_epoch) == list(range(100, 112))
    state = json.loads(json.dumps(it.state()))
    expected = [it.next_batch() for _ in range(3)]
    again = PackedIterator([big, small], 8, B, weights=[3, 1], seed=0)
    again.restore(state)
    for e in expected:
        np.testing.assert_array_equal(e.tokens, again.next_batch().tokens)
    with pytest.raises(DataError, match="weights"):
        PackedIterator([big, small], 8, B, weights=[1, 1]).restore(state)
    with pytest.raises(DataError, match="one positive number per source"):
        PackedIterator([big, small], 8, B, weights=[1])
    with pytest.raises(ConfigError, match="data.weights must be one positive number per data.path entry"):
        DataConfig(path=("a.jsonl", "b.jsonl"), weights=(1.0,))


def test_order_deterministic_from_seed_and_resumable():
    docs = Documents.from_lists([[i + 5] * (2 + i % 5) for i in range(30)])
    a = PackedIterator(docs, 12, 2, seed=1)
    b = PackedIterator(docs, 12, 2, seed=1)
    c = PackedIterator(docs, 12, 2, seed=2)
    first = [a.next_batch().tokens for _ in range(3)]
    np.testing.assert_array_equal(first, [b.next_batch().tokens for _ in range(3)])
    assert not np.array_equal(first, [c.next_batch().tokens for _ in range(3)])
    for _ in range(10):  # past an epoch boundary
        a.next_batch()
    state = json.loads(json.dumps(a.state()))  # JSON round trip, as in a checkpoint
    expected = [a.next_batch() for _ in range(8)]
    d = PackedIterator(docs, 12, 2, seed=1)
    d.restore(state)
    for e in expected:
        for x, y in zip(e, d.next_batch()):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(DataError, match="seq_len"):
        PackedIterator(docs, 10, 2, seed=1).restore(state)
    # a state with documents waiting for look-ahead packing (an option this version does not have)
    with pytest.raises(DataError, match="look-ahead packing"):
        d.restore({**state, "lookahead": 16, "pending": [[3, 0]]})
    # a state of the single-order packer (before rows were streams): refused, not continued differently
    with pytest.raises(DataError, match="another version of the packer"):
        d.restore({"epoch": 1, "cursor": 3, "offset": 0, "rows": 20, "seed": 1, "seq_len": 12, "copy_len": 12})


# ---------------------------------------------------------------------------------------------- files


def _write_all_formats(tmp, records):
    ds = datasets.Dataset.from_list(records)
    ds.to_json(tmp / "d.jsonl")
    ds.to_parquet(tmp / "d.parquet")
    ds.save_to_disk(str(tmp / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp / "saved_dict"))
    arrow = next((tmp / "saved").glob("*.arrow"))
    return {"jsonl": tmp / "d.jsonl", "parquet": tmp / "d.parquet", "disk": tmp / "saved",
            "disk_dict": tmp / "saved_dict", "arrow": arrow}


def test_text_from_every_source_format(tmp_path, tok_dir):
    paths = _write_all_formats(tmp_path, [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    batches = {}
    for name, p in paths.items():
        cfg = DataConfig(path=str(p), tokenizer=str(tok_dir), seq_len=16, seed=0, cache_dir=str(tmp_path / "c"))
        it = build_iterator(cfg, batch_size=3)
        batches[name] = it.next_batch()
        _check_rows(batches[name], 16)
    for name, b in batches.items():
        for x, y in zip(b, batches["jsonl"]):
            np.testing.assert_array_equal(x, y, err_msg=name)
    # every segment is one tokenized text: BOS (post-processor) + words + EOS (add_eos)
    expected = {tuple([1] + ids(t) + [2]) for t in TEXTS}
    b = batches["jsonl"]
    for t, s in zip(b.tokens, b.segment):
        for k in range(1, s.max() + 1):
            assert tuple(t[s == k].tolist()) in expected


def test_prompt_response_with_chat_template(tmp_path, tok_dir):
    recs = [{"prompt": "hello world", "response": "yes"}, {"prompt": "the cat sat", "response": "no no"}]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    cfg = DataConfig(path=str(tmp_path / "sft.jsonl"), tokenizer=str(tok_dir), seq_len=32, shuffle=False,
                     cache_dir=str(tmp_path / "c"))
    b = build_iterator(cfg, 1).next_batch()
    t, s, lm = b.tokens[0], b.segment[0], b.loss_mask[0]
    doc1 = t[s == 1].tolist()
    prompt = [1] + ids("<|user|> hello world </s> <|assistant|>")
    assert doc1 == prompt + ids("yes </s>")
    np.testing.assert_array_equal(lm[s == 1], [0] * len(prompt) + [1, 1])  # only the response counts
    assert t[s == 2].tolist() == [1] + ids("<|user|> the cat sat </s> <|assistant|> no no </s>")
    # without the template: prompt (BOS + words) then response + EOS
    cfg2 = DataConfig(path=str(tmp_path / "sft.jsonl"), tokenizer=str(tok_dir), seq_len=32, shuffle=False,
                      chat_template=False, cache_dir=str(tmp_path / "c"))
    b2 = build_iterator(cfg2, 1).next_batch()
    assert b2.tokens[0][b2.segment[0] == 1].tolist() == [1] + ids("hello world yes </s>")
    np.testing.assert_array_equal(b2.loss_mask[0][b2.segment[0] == 1], [0, 0, 0, 1, 1])


def test_callable_tokenizer(tmp_path):
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    cfg = DataConfig(path=str(tmp_path / "t.jsonl"), seq_len=64, shuffle=False, cache_dir=str(tmp_path / "c"))
    it = build_iterator(cfg, 1, tokenizer=lambda s: [len(w) + 10 for w in s.split()], eos_id=2)
    t = it.next_batch().tokens[0]
    assert t[:7].tolist() == [13, 13, 13, 12, 11, 13, 2]  # "the cat sat on a mat" + EOS


def test_load_tokenizer_reads_config(tok_dir):
    tk = Tokenizer.load(tok_dir)
    assert tk.eos_id == 2 and tk.chat_template == TEMPLATE and tk.encode("hello world") == [1] + ids("hello world")
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.load(tok_dir / "nope.json")


def test_errors_name_the_problem(tmp_path, tok_dir):
    base = {"tokenizer": str(tok_dir), "seq_len": 16, "cache_dir": str(tmp_path / "c")}
    with pytest.raises(DataError, match="does not exist"):
        build_iterator(DataConfig(path=str(tmp_path / "missing.jsonl"), **base), 1)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "the cat"}) + "\n")
    with pytest.raises(DataError, match=r"columns: \['body'\]"):
        build_iterator(DataConfig(path=str(tmp_path / "bad.jsonl"), **base), 1)
    (tmp_path / "empty.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["", "", ""]) + "\n")
    with pytest.raises(DataError, match="no usable rows"):
        build_iterator(DataConfig(path=str(tmp_path / "empty.jsonl"), **base), 1)
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": " ".join(["the"] * 40), "response": "yes"}) + "\n")
    with pytest.raises(DataError, match="no usable rows"):
        build_iterator(DataConfig(path=str(tmp_path / "long.jsonl"), **base), 1)
    (tmp_path / "w").mkdir()
    paths = _write_all_formats(tmp_path / "w", [{"text": t} for t in TEXTS])
    with pytest.raises(DataError, match="split 'validation'"):
        build_iterator(DataConfig(path=str(paths["disk_dict"]), split="validation", **base), 1)


# ---------------------------------------------------------------------------------------------- the store


def _counting(tok_dir):
    """The tokenizer of tok_dir with the texts it encodes counted (one by one or in a batch)."""
    tk = Tokenizer.load(tok_dir)
    calls, encode, many = [0], tk._encode, tk._encode_many

    def counted(text, add_special_tokens):
        calls[0] += 1
        return encode(text, add_special_tokens)

    def counted_many(texts, add_special_tokens):
        calls[0] += len(texts)
        return many(texts, add_special_tokens)
    tk._encode, tk._encode_many = counted, counted_many
    return tk, calls


def test_store_is_made_once_and_reused(tmp_path, tok_dir):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = DataConfig(path=str(tmp_path / "t.jsonl"), tokenizer=str(tok_dir), seq_len=16, store_dir=str(tmp_path / "s"))
    tk, calls = _counting(tok_dir)
    first = build_iterator(cfg, 2, tokenizer=tk)
    assert calls[0] == len(TEXTS) and len(list((tmp_path / "s").iterdir())) == 1
    again = build_iterator(cfg, 2, tokenizer=tk)  # a restart: no tokenizer call, the same rows
    assert calls[0] == len(TEXTS) and again.report["store"] == first.report["store"]
    for _ in range(3):
        for x, y in zip(first.next_batch(), again.next_batch()):
            np.testing.assert_array_equal(x, y)
    assert isinstance(again.docs.values, FileArray)  # read per piece, never loaded or mapped
    assert first.report["records"] == first.report["used"] == len(TEXTS)
    # another setting, another tokenizer, or a changed file: another store
    build_iterator(DataConfig(**{**cfg.__dict__, "add_eos": False}), 2, tokenizer=tk)
    assert calls[0] == 2 * len(TEXTS) and len(list((tmp_path / "s").iterdir())) == 2
    other = tmp_path / "tok2"
    other.mkdir()
    (other / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text().replace('"far"', '"FAR"'))
    (other / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    build_iterator(DataConfig(**{**cfg.__dict__, "tokenizer": str(other)}), 2)
    assert len(list((tmp_path / "s").iterdir())) == 3
    state = json.loads(json.dumps(first.state()))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[::-1]))
    edited = build_iterator(cfg, 2, tokenizer=tk)
    assert calls[0] == 3 * len(TEXTS) and len(list((tmp_path / "s").iterdir())) == 4
    with pytest.raises(DataError, match="content digests"):  # as many records, other content: not resumed onto
        edited.restore(state)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    build_iterator(cfg, 2, tokenizer=tk).restore(state)  # the same content written again (a new store): resumes
    assert not list((tmp_path / "s").glob(".*"))  # no partial store left behind
    (tmp_path / "file").write_text("")  # a store_dir that cannot be written: named before any tokenizing
    with pytest.raises(DataError, match=r"data.store_dir '.*file/s' cannot be written \(Not a directory\)"):
        build_iterator(DataConfig(**{**cfg.__dict__, "store_dir": str(tmp_path / "file" / "s"), "seed": 5}), 2,
                       tokenizer=tk)


def test_nothing_is_dropped_in_silence(tmp_path, tok_dir):
    """95 of 100 records lack "response": an error naming the share and the first bad line; allowed, the report
    counts each reason with its first record."""
    recs = [{"prompt": "hello world", "response": "yes"} if i % 20 == 0 else {"prompt": "the cat"} for i in range(100)]
    recs[41] = {"prompt": "the dog", "response": ""}
    (tmp_path / "sft.jsonl").write_text("\n" + "".join(json.dumps(r) + "\n" for r in recs))  # a blank first line
    cfg = DataConfig(path=str(tmp_path / "sft.jsonl"), tokenizer=str(tok_dir), seq_len=16)
    with pytest.raises(DataError, match=r"95\.0% of the records are unusable \(95 of 100: missing_field 94 "
                                        r"\(first: .*sft.jsonl line 3\), empty 1 \(first: .*sft.jsonl line 43\)\)"):
        build_iterator(cfg, 1)
    it = build_iterator(DataConfig(**{**cfg.__dict__, "max_drop_share": 1.0}), 1)
    r = it.report
    assert (r["records"], r["used"], r["dropped"]["missing_field"]["count"], r["dropped"]["empty"]["count"]) == \
        (100, 5, 94, 1)
    # packing drops too: a prompt that leaves no response token inside seq_len, with its line
    recs = [{"prompt": "hello world", "response": "yes"}] * 3 + [{"prompt": " ".join(["the"] * 40), "response": "no"}]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(DataError, match=r"25\.0% .* no_response_in_seq_len 1 \(first: .*long.jsonl line 4\)"):
        build_iterator(DataConfig(path=str(tmp_path / "long.jsonl"), tokenizer=str(tok_dir), seq_len=16), 1)


def test_bad_files_and_ids_are_clear_errors(tmp_path, tok_dir):
    base = {"tokenizer": str(tok_dir), "seq_len": 16}
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl' is empty"):
        build_iterator(DataConfig(path=str(tmp_path / "empty.jsonl"), **base), 1)
    (tmp_path / "notjson.jsonl").write_text("hello world\nthe cat\n")
    with pytest.raises(DataError, match="notjson.jsonl' cannot be read as json"):
        build_iterator(DataConfig(path=str(tmp_path / "notjson.jsonl"), **base), 1)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    with pytest.raises(DataError, match=r"token id 25 is outside the model's vocabulary \(vocab_size 20\)"):
        build_iterator(DataConfig(path=str(tmp_path / "t.jsonl"), **base), 1, vocab_size=20)


def test_several_files_mixed_each_its_own_store(tmp_path, tok_dir):
    """data.path a list + data.weights: one store per source, a report per source and in all; a source with too
    many unusable records is an error naming it."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": "yes no yes"}) + "\n" for _ in range(5)))
    cfg = DataConfig(path=(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")), weights=(1.0, 1.0),
                     tokenizer=str(tok_dir), seq_len=16, store_dir=str(tmp_path / "s"))
    it = build_iterator(cfg, 2)
    r = it.report
    assert [s["path"] for s in r["sources"]] == list(cfg.path) and len(list((tmp_path / "s").iterdir())) == 2
    assert (r["records"], r["used"]) == (len(TEXTS) + 5, len(TEXTS) + 5)
    yes = ids("yes no yes")
    rows = [t[s == k].tolist() for _ in range(4) for t, s in zip(*it.next_batch()[:2]) for k in range(1, s.max() + 1)]
    assert 0.3 < sum(d[1:4] == yes for d in rows) / len(rows) < 0.7  # half the documents from b
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n" + json.dumps({"other": 1}) + "\n")
    bad = DataConfig(**{**cfg.__dict__, "path": (str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl"))})
    with pytest.raises(DataError, match=r"dataset '.*c.jsonl': 50.0% of the records are unusable"):
        build_iterator(bad, 2)
