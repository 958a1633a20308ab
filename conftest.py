"""Test-session setup shared by the unit tests and nbval.

Notebook kernels inherit this process's environment, so setting the variables
here puts every notebook in quick mode and points it at the offline data.
"""

import os
from pathlib import Path

os.environ.setdefault("D2LGPU_QUICK", "1")

_shared_data = Path(__file__).resolve().parent.parent / "shared" / "data"
if "D2LGPU_DATA" not in os.environ and (_shared_data / "FashionMNIST" / "raw").is_dir():
    os.environ["D2LGPU_DATA"] = str(_shared_data)
