"""``python -m kvbm.s3server start|stop|status --dir D``."""

import sys

from kvbm.s3server.cli import main

sys.exit(main())
