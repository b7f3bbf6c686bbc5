"""`probe`: the runs agent's probe on each target and its document."""
