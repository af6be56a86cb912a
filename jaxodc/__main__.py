import sys

from jaxodc.cli import main

sys.exit(main())
