#!/usr/bin/env python3
"""llamassp: how much faster does a draft model make a target model generate? See README.md."""
import sys

from lssp.cli import main

if __name__ == "__main__":
    sys.exit(main())
