"""`python -m bamboo.membership`: run one node's agent (see `bamboo.membership.cli`, `--help`)."""

import sys

from bamboo.membership.cli import main

sys.exit(main())
