"""Training utilities: checkpointing (`checkpoint.py`: Checkpointer) and metrics (`metrics.py`:
MetricsWriter, Progress, plot_metrics, read_jsonl, summary_table).

Import the submodules directly; this package imports nothing itself so it stays cheap to import.
"""
