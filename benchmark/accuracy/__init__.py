"""Offline long-context accuracy tasks, scorers and the per-mode evaluation runner (issue 6, item 1).

Pure Python: nothing here imports sglang. Generators are deterministic functions of a seed; the
runner (`run_eval.py`) talks HTTP to a running server and writes JSON lines, tables and plots.
"""
