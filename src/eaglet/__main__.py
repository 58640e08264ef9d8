"""`python -m eaglet ...` is the `eaglet` command."""

import sys

from eaglet.cli import main

sys.exit(main())
