import sys

from ferry.cli import main

sys.exit(main())
