import sys

from lssp.cli import main

sys.exit(main())
