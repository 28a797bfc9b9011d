"""``python -m bamboo.bench``: the ``bamboo-bench`` command (``compare`` runs each system this way)."""

import sys

from bamboo.bench.cli import main

sys.exit(main())
