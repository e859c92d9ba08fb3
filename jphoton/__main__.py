import sys

from jphoton.cli import main

sys.exit(main())
