"""``python -m bamboo.bench.cli``: the ``bamboo-bench`` command."""

import sys

from bamboo.bench.cli import main

sys.exit(main())
