"""The probe program (`python -m trainer.probe`): program.py the parent, case.py one case in its own
process, build.py the build report. This file imports nothing (the orchestrator never imports torch).
"""
