"""The runs agent (entry `runs.runs_agent`): launch, status, follow, stop, metrics, export, probe, rm,
prune on the target."""
