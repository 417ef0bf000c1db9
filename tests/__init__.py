"""The test suite. The checkout's root is on sys.path while it runs (pytest's rootdir, `python -m
pytest`'s cwd): first thing, it is moved behind the installed packages, where its kernels/ folder
cannot shadow PyPI's `kernels` (transformers imports that one); moe-serve itself is imported as
installed, moe_serve.*. Child processes get PYTHONSAFEPATH: no cwd or script folder put first."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = ([p for p in sys.path if os.path.abspath(p or ".") != _ROOT]
               + [p for p in sys.path if os.path.abspath(p or ".") == _ROOT])
os.environ["PYTHONSAFEPATH"] = "1"
