"""`--format hf` read as TRL reads it, without seqpack: HF `datasets.load_dataset("parquet")`,
`DataCollatorForLanguageModeling(padding_free=True)` and two steps of `SFTTrainer` on a tiny
random Llama with `dataset_kwargs={"skip_prepare_dataset": True}`. Usage: trl_rows.py OUT
INPUT...

Followed: trl 1.16.0, `trl/trainer/sft_trainer.py` (huggingface/trl
f2cd57710ae345ea6428ae95363267fcf38a3dc8): the collator builds `position_ids` from `seq_lengths`
and sets the label of each segment's first position to -100.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

import numpy as np
from inputs import done, examples, loss, source

out, paths = sys.argv[1], sys.argv[2:]
ex = examples(paths)
manifest = json.load(open(os.path.join(out, "manifest.json")))
files = sorted(glob.glob(os.path.join(out, "*.parquet")))
assert [os.path.basename(p) for p in files] == manifest["shards"]

import datasets  # noqa: E402
import torch  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

ds = datasets.load_dataset("parquet", data_files=files, split="train")
assert len(ds) == manifest["num_rows"]
seen = []
for r, row in enumerate(ds):
    a = 0
    assert sum(row["seq_lengths"]) == len(row["input_ids"]) <= manifest["seq_len"]
    for m, i, s in zip(row["seq_lengths"], row["segment_source_index"],
                       row["segment_source_start"]):
        assert row["input_ids"][a : a + m] == source(ex, i, s, m, "input_ids").tolist()
        want = np.where(loss(ex, i, s, m), source(ex, i, s, m, "labels"), -100)
        assert row["labels"][a : a + m] == want.tolist(), r
        assert row["position_ids"][a : a + m] == list(range(m))
        seen.append((i, s, m))
        a += m
covered = {}
for i, s, m in sorted(seen):
    assert covered.get(i, 0) == s, ("a piece missing or twice", i, s)
    covered[i] = s + m
assert all(covered.get(i, 0) == len(e["input_ids"]) for i, e in enumerate(ex))

collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
rows = [ds[i] for i in range(min(4, len(ds)))]
batch = collator(rows)
assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
assert batch["input_ids"][0].tolist() == sum((x["input_ids"] for x in rows), [])
assert batch["position_ids"][0].tolist() == sum((x["position_ids"] for x in rows), [])
labels = torch.tensor(sum((x["labels"] for x in rows), []))
labels[batch["position_ids"][0] == 0] = -100
assert batch["labels"][0].tolist() == labels.tolist()

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

vocab = 1 + max(max(x["input_ids"], default=0) for x in ds)
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
    {f"t{i}": i for i in range(vocab)}, unk_token="t0")), pad_token="t0", eos_token="t1")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, max_position_embeddings=512))
with tempfile.TemporaryDirectory() as tmp:
    args = SFTConfig(output_dir=tmp, padding_free=True, max_length=None, max_steps=2,
                     per_device_train_batch_size=2, report_to="none", use_cpu=True,
                     dataset_kwargs={"skip_prepare_dataset": True}, save_strategy="no",
                     logging_steps=1)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    first = next(iter(trainer.get_train_dataloader()))
    assert set(first) >= {"input_ids", "labels", "position_ids"}, set(first)
    result = trainer.train()
    assert np.isfinite(result.training_loss), result
done(f"{len(ds)} rows, {len(seen)} segments, loss {result.training_loss:.3f}")
