"""The remote agent: programs run by the TARGET's python, standard library only, Python >= 3.8.

Never imported by the controller: orchestrator/agent.py reads these files and joins an entry
module (`release_agent`, `runs_agent`) and everything it imports into one `python -c` source.
"""
