"""`python -m berth`: the same as the `berth` command."""
import sys

from berth.main import main

sys.exit(main())
