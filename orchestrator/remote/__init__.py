"""The remote agent: programs run by the TARGET's python, standard library only, Python >= 3.8.

orchestrator/ssh/agent_call.py reads these files and joins an entry module (`release.release_agent`,
`runs.runs_agent`) and everything it imports into one `python -c` source. The controller imports one
of them as is, runs/kinds.py (it imports no other part): the kinds of run and the trainer's argv.
`common.py` is what both programs share; `release/` and `runs/` hold each program's parts.
"""
