"""``python -m tenplex.cli``: the same as the ``tenplex`` command."""

import sys

from . import main

sys.exit(main())
