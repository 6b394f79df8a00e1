"""pytest setup for the Python tests (make test-python): the package from this tree, the binary
from the build, MPICH's mpiexec, one thread per rank."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("MESHDIT_BIN", os.path.join(ROOT, "build", "meshdit"))
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.pop("OPENBLAS_CORETYPE", None)
