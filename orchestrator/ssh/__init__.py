"""Reaching targets: the transport seam, the SSH dial, the per-command session, and the agent
call with its fan-out."""
