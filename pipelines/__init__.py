"""seqpack's pipelines, one folder per dependency:

- `formats/`: input and output formats (one reader per format, shared by the CLI and the Grain
  sources), the SQP1 record codec and the manifest. numpy, plus pyarrow / array-record where a
  format needs them.
- `offline/`: the offline job behind the CLI: writer, verify, report, the Beam job. No grain.
- `datasets/`: the Grain datasets (packing `IterDataset`s, drop-ins, sources, training pipeline).
  The only folder that imports grain.
"""
