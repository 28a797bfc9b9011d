"""`python -m bamboo.membership`: run one node's agent (see `bamboo.membership.agent.main`, `--help`)."""

import sys

from bamboo.membership.agent import main

sys.exit(main())
