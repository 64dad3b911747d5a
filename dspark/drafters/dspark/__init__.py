"""The DSpark drafter: its network (numpy reference, `model.py`), its kernels (`kernel.py`) and
its block schedule (`schedule.py`)."""
