"""The one set of test helpers: `files` (input files, the CLI), `packer` (corpora, losslessness),
`pipelines` (Grain sources, restore checks), `kernels` (cases, interpret mode), `device` (the
device suite's rows, sizes and tolerances: jax, numpy and seqpack.kernels alone)."""
