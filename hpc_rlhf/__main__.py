import sys

from hpc_rlhf.cli import main

sys.exit(main())
