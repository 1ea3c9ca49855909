"""`python -m engine.cli ...`: the `strata` command line, engine/frontends/cli.py (kept as a path the
tests, the bench and the README run)."""
import sys

from engine.frontends.cli import main

if __name__ == "__main__":
    sys.exit(main())
