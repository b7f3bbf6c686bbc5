"""The targets themselves: `targets` (listing, --check), `exec` (a command per target), `scan`
(saved logs, offline)."""
