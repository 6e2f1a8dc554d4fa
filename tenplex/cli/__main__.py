"""``python -m tenplex.cli``: the same as the ``tenplex`` command. May import: ``tenplex.cli``."""

import sys

from . import main

sys.exit(main())
