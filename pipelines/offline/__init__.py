"""The offline job: ArrayRecord shards + manifest, verify, report, the Beam job (no grain)."""
