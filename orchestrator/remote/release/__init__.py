"""The release agent (entry `release.agent`): deploy's manifest, apply and install-deps on the
target."""
