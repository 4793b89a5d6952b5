"""Installs the simulated device (tests/simulated_device.py) at start-up in a process a test
started with ``install_in_rank_processes``: the ranks of a pipeline- or tensor-parallel engine
that rank 0 (the test) spawns. Only on PYTHONPATH in those tests; nothing happens without the
variable."""
import json
import os
import sys
from pathlib import Path

_DIRS = os.environ.get("TRTBUILD_SIMULATED_DEVICE_DIRS")
if _DIRS:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: simulated_device, simulated_tensorrt
    from simulated_device import SimulatedDevice

    sys.modules.update(SimulatedDevice().modules([Path(p) for p in json.loads(_DIRS)]))
