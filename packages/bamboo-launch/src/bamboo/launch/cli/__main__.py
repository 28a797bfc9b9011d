"""``python -m bamboo.launch.cli``: the ``bamboo-launch`` command."""

import sys

from bamboo.launch.cli import main

sys.exit(main())
