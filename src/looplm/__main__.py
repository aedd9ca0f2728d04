"""``python -m looplm``: the same command line as the ``looplm`` script."""
import sys

from looplm.cli import main

sys.exit(main())
