"""``python -m durable_dataflow.cli``: the same as the ``dataflow`` console script."""

import sys

from durable_dataflow.cli import main

sys.exit(main())
