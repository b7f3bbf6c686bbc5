"""The bundled DFlash drafter trainer: `python -m trainer`, `python -m trainer.eval`.

Runs on the training target and imports torch; nothing in this package knows SSH exists.
This file stays free of imports so that `import trainer` (and the probe) cost nothing.
"""
