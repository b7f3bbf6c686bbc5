"""Runs (a job of one or more nodes): launch, logs, status, stop, report, export, rm, prune."""
