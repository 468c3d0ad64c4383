"""`python -m pipejob.cli`: the `pipejob` command."""

import sys

from pipejob.cli.main import main

sys.exit(main())
