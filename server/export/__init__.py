"""Stored conversations as RL training rollouts: building them (``rollouts``), writing them
(``writers``: JSONL, Parquet) and the export command's driver (``run``)."""
