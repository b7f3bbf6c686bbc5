"""`deploy`: the file set, the manifest diff and the release agent's atomic flip."""
