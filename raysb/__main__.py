import sys

from raysb.cli import main

sys.exit(main())
