"""Each `--format` read by its consumer's own code, in a process that never imports seqpack
(the scripts in tests/consumers/): pyarrow, pandas and DuckDB (HF `datasets` and Spark SQL
too, slow) for `parquet`; HF `datasets`, TRL's padding-free collator and `SFTTrainer` for `hf`
(slow: torch); Megatron-Bridge's schema, `validate_row`, shifted loss mask and metadata,
written from its source, for `megatron`. Every script checks every segment against the example
it came from."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from seqpack.pipelines.offline.runners import pack_to_dir
from tests.helpers.formats import job, write_sft

SCRIPTS = pathlib.Path(__file__).parent / "consumers"


def pack(tmp_path, fmt: str, seed: int = 3) -> tuple[str, list[str]]:
    rng = np.random.default_rng(seed)
    paths = [write_sft(tmp_path / f"in{i}.parquet", rng, 60) for i in range(2)]
    out = str(tmp_path / fmt)
    pack_to_dir(job(paths, out, fmt, workers=1))
    return out, paths


def consume(script: str, *args: str, timeout: float = 300) -> str:
    """Runs a consumer script in a fresh interpreter (cwd: the scripts' folder, not the
    repository, so nothing of seqpack is on its path)."""
    result = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=SCRIPTS,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith("OK"), result.stdout[-2000:]
    return result.stdout


def test_parquet_rows_read_by_pyarrow_pandas_and_duckdb(tmp_path):
    pytest.importorskip("duckdb")
    pytest.importorskip("pandas")
    out, paths = pack(tmp_path, "parquet")
    consume("parquet_rows.py", out, *paths)


def test_megatron_rows_as_megatron_bridge_reads_them(tmp_path):
    out, paths = pack(tmp_path, "megatron")
    consume("megatron_rows.py", out, *paths)


@pytest.mark.slow
def test_parquet_rows_read_by_hf_datasets(tmp_path):
    pytest.importorskip("datasets")
    out, paths = pack(tmp_path, "parquet")
    consume("parquet_rows.py", out, *paths, "--datasets")


@pytest.mark.slow
def test_parquet_rows_read_by_spark(tmp_path):
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.skip("Spark needs java")
    out, paths = pack(tmp_path, "parquet")
    consume("parquet_rows.py", out, *paths, "--spark")


@pytest.mark.slow
def test_hf_rows_train_with_trl_padding_free(tmp_path):
    pytest.importorskip("trl")
    out, paths = pack(tmp_path, "hf")
    consume("trl_rows.py", out, *paths, timeout=600)
