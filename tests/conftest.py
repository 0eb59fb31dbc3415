import sys
from pathlib import Path

# Tests import the mpiexec launcher, and the experiments' modules as the scripts do (top level).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "experiments"))
