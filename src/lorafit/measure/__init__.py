"""`lorafit measure` and `make gpu-check`: real training steps on this machine, measured beside the estimate.

engine.py builds, loads and trains the model and reads its memory (shared with bench/gpu_check.py); run.py
measures one plan; store.py keeps the measurements and exports them as calibration rows; cli.py is the command.
"""
