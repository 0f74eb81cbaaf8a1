"""`python -m einpage.cli`: the `einpage` command line."""

import sys

from einpage.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
