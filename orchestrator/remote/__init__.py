"""The remote agent: programs run by the TARGET's python, standard library only, Python >= 3.8.

Never imported by the controller: orchestrator/ssh/agent.py reads these files and joins an entry
module (`release.agent`, `runs.agent`) and everything it imports into one `python -c` source.
`common.py` is what both programs share; `release/` and `runs/` hold each program's parts.
"""
