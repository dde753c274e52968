"""Added evaluation tasks, one module each, imported by the task registry (``evaluation/registry.py``).

A generation task is a ``generation_tasks.GenerationTask`` subclass under ``@generation_task`` (its rows, stop
sequences, headline metric and scorer); an lm-eval multiple-choice task is an offline config (``*.yaml`` here)
with its rows in ``task_data.py``. The YAML files beside this package are lm-eval's task configs, which lm-eval
reads itself.
"""
