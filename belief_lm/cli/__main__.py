"""`python -m belief_lm.cli`: the `belief-lm` command with this interpreter (what `launch
local`, torchrun and the tests start)."""

import sys

from belief_lm.cli import main

sys.exit(main())
