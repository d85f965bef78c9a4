"""`python -m hotprefix ...` runs the `hotprefix` command."""

import sys

from hotprefix.cli import main

sys.exit(main())
