import sys

from gpudra.cli import main

sys.exit(main())
