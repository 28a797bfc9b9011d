"""``python -m bamboo.launch``: the ``bamboo-launch`` command."""

import sys

from bamboo.launch.cli import main

sys.exit(main())
