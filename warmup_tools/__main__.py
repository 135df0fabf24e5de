import sys

from warmup_tools.ops.cli import main

sys.exit(main())
