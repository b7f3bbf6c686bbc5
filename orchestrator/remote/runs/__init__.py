"""The runs agent (entry `runs.agent`): launch, status, follow, stop, metrics, export, probe, rm,
prune on the target."""
