"""The device-agnostic engine: request state, scheduling and block accounting in plain Python,
every torch detail in `runner.py`, `sampling.py` and `kv_package.py`."""
