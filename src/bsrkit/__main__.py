"""``python -m bsrkit``: the ``bsrkit`` command (:mod:`bsrkit.cli`)."""

import sys

from bsrkit.cli import main

sys.exit(main())
