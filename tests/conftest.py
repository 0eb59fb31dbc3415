import sys
from pathlib import Path

# Tests import the mpiexec launcher as a top-level module.
sys.path.insert(0, str(Path(__file__).parent))
