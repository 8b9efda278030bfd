"""Offline long-context accuracy tasks, scorers and the per-mode evaluation runner (issue 6, item 1).

Pure Python: nothing here imports sglang. Generators are deterministic functions of a seed; the
runner (`run_eval.py`) talks HTTP to a running server and writes JSON lines, tables and plots.

Public API (import from the modules named):
- task_registry: `generate_instances(tasks, context_lengths, seeds, counter, depths, num_needles,
  hops) -> list[TaskInstance]`, `generate_one(task, seed, context_tokens, depth, counter)`,
  `parse_task_names(names)`.
- token_count: `load_token_counter(tokenizer_dir=None) -> TokenCounter` (HF tokenizer or chars/4).
- scorers: `score_instance(instance, prediction) -> float`, `exact_match`, `rouge_l_f1`,
  `token_agreement(reference_tokens, candidate_tokens) -> TokenAgreement`.
- eval_loop: `run_instances(client, instances, mode, concurrency, deadline_s, on_record) -> records`.
- http_client: `CompletionClient(base_url, api, max_new_tokens, timeout_s, model, chat_renderer)`.
- aggregate: `load_records`, `accuracy_rows`, `accuracy_table`, `agreement_rows`, `agreement_table`.
- plot: `plot_accuracy_vs_context(rows, path, caption)`.
- CLI: `python -m benchmark.accuracy.run_eval --help`.
"""
