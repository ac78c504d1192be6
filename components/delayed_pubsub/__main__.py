"""`python -m delayed_pubsub`: the same as the `delayed-pubsub` console script."""

import sys

from delayed_pubsub.cli import main

sys.exit(main())
