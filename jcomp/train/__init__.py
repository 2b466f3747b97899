"""The training run. At its door `loop` (`train_and_evaluate`, what train.py
calls) and `plan` (`python -m jcomp.train.plan`); behind it, bottom to top:
`run` (the run's machinery), `outer` (the outer loop), `settings` (the config
read once), `state` (resume, the compiled steps), `auto` (compression.auto)."""
