"""Text inputs in bounded memory: peak RSS and seconds of reading text files, against a revision.

    python -m benchmarks.text_bench [--baseline REV] [--doc-mb 10] [--lines-mb 100]

A byte-level BPE tokenizer (GPT-2's pre-tokenizer, 8,192 ids) and a Unigram one (T5's way:
whitespace made a space, then Metaspace's words) are trained on 2 MB of seeded Zipf-distributed
words; then each case reads one file with `formats.text.read_chunks` in a child process of its
own (peak RSS: the child's from just before reading, "startup" its RSS then), once with this
tree's `pipelines/formats/text.py` and once with the baseline revision's (loaded from git into
the same seqpack). "same ids" compares a digest of every chunk's ids and lengths. Cases: one
document of --doc-mb MB (`--text-unit file`; by each tokenizer), the same text as --lines-mb
MB of lines (`line`) and of paragraphs (`paragraph`), tokenized and as raw UTF-8 bytes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.common import file_at, print_table

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import hashlib, importlib.util, json, resource, sys, time
import numpy as np
src, path, unit, tok_path = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("text_under_test", src)
text = importlib.util.module_from_spec(spec)
spec.loader.exec_module(text)
tok = text.load_tokenizer(tok_path) if tok_path != "-" else None
def hwm():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
startup = rss()
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on (VmHWM)
t0, ids, lengths = time.perf_counter(), hashlib.sha1(), hashlib.sha1()
tokens, examples, dtypes = 0, 0, set()
for c in text.read_chunks(path, tok, unit):
    ids.update(c.values.tobytes())
    dtypes.add(c.values.dtype.str)
    lengths.update(np.diff(c.offsets).astype(np.int64).tobytes())
    tokens, examples = tokens + int(c.values.size), examples + c.num_records
print(json.dumps({"s": time.perf_counter() - t0, "startup": startup,
                  "peak": hwm(),
                  "tokens": tokens, "examples": examples,
                  "digest": [ids.hexdigest(), lengths.hexdigest(), sorted(dtypes)]}))
"""


def _words(nbytes: int, seed: int) -> str:
    """About `nbytes` of Zipf-distributed pseudo-words, sentences, lines and paragraphs."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = ["".join(rng.choice(letters, rng.integers(1, 11))) for _ in range(20_000)]
    n = nbytes // 6
    words = np.asarray(vocab, dtype=object)[np.minimum(rng.zipf(1.2, n), len(vocab)) - 1]
    ends = rng.random(n)
    seps = np.where(ends < 0.005, ".\n\n", np.where(ends < 0.05, ".\n", np.where(
        ends < 0.08, ", ", " ")))
    return "".join(w + s for w, s in zip(words.tolist(), seps.tolist()))


def _tokenizer(path: pathlib.Path, sample: str, unigram: bool = False) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if unigram:  # T5's way: SentencePiece's Unigram over Metaspace's words, whitespace a space
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Replace(Regex(r"\s"), " ")
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.train_from_iterator(sample.splitlines(), trainers.UnigramTrainer(
            vocab_size=8192, show_progress=False, unk_token="<unk>", special_tokens=["<unk>"]))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(sample.splitlines(), trainers.BpeTrainer(
            vocab_size=8192, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def _run(src: pathlib.Path, path: pathlib.Path, unit: str, tok: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(path), unit, tok],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision compared against")
    ap.add_argument("--doc-mb", type=float, default=10)
    ap.add_argument("--lines-mb", type=float, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        base = file_at(args.baseline, "pipelines/formats/text.py", tmp / "text_base.py")
        here = ROOT / "pipelines" / "formats" / "text.py"
        doc = _words(int(args.doc_mb * 1e6), 0)
        tok = _tokenizer(tmp / "tokenizer.json", doc[:2_000_000])
        unigram = _tokenizer(tmp / "unigram.json", doc[:2_000_000], unigram=True)
        (tmp / "doc.txt").write_text(doc)
        with open(tmp / "lines.txt", "w") as f:
            for _ in range(max(1, round(args.lines_mb / args.doc_mb))):
                f.write(doc)
        cases = [("doc.txt", "file", tok), ("doc.txt", "file", unigram),
                 ("lines.txt", "line", tok),
                 ("lines.txt", "paragraph", tok), ("lines.txt", "line", "-")]
        rows = []
        for name, unit, t in cases:
            new, old = _run(here, tmp / name, unit, t), _run(base, tmp / name, unit, t)
            size = (tmp / name).stat().st_size / 1e6
            rows.append([f"{name} ({size:.0f} MB)", unit, "no (bytes)" if t == "-" else
                         "Unigram 8K" if t == unigram else "BPE 8K",
                         f"{new['examples']:,}", f"{new['tokens']:,}",
                         f"{old['peak']:.0f} / {old['s']:.1f}",
                         f"{new['peak']:.0f} / {new['s']:.1f}", f"{new['startup']:.0f}",
                         "yes" if new["digest"] == old["digest"] else "NO"])
    print_table(f"text inputs read with formats.text.read_chunks, {args.baseline} vs this tree "
                "(peak RSS MiB / seconds, a child process each)",
                ["file", "unit", "tokenizer", "examples", "ids", f"{args.baseline}",
                 "this tree", "startup MiB", "same ids"], rows)


if __name__ == "__main__":
    main()
