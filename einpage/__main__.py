"""`python -m einpage`: the `einpage` command line (`einpage.cli.main`)."""

import sys

from einpage.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
