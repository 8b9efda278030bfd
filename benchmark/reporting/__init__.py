"""Report generation for BENCHMARKS.md: result sources, tables and figures (see benchmark/report.py)."""
