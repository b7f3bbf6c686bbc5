"""The release agent (entry `release.release_agent`): deploy's manifest, apply and install-deps on the
target."""
