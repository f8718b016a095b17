"""`python -m eqx_lean.memory`: plans for GPUs and TPUs from any machine (see `--help`)."""

import sys

from eqx_lean._memory.cli import main


sys.exit(main())
