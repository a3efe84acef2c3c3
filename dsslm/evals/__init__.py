"""Downstream evaluation by ranked classification (RC), in the training loop and from `dsslm.eval`
(docs/evals.md): `tasks.py` reads and checks the task data, `scoring.py` tokenizes the requests as
lm-eval-harness does and scores them, `loop.py` runs them every `eval.every` steps."""
