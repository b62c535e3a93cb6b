"""recsz: distributed DLRM training with an error-bounded compressed embedding all-to-all."""

__version__ = "0.1.0"

from recsz.interpreter import install as _install_interpreter

_install_interpreter()
