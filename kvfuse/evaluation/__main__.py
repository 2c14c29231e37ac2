"""`python -m kvfuse.evaluation [eval] ...`: the `kvfuse eval` command on its own."""
import sys

from .cli import main

sys.exit(main())
