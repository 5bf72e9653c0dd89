"""``python -m asynclock._cli``: the same as the ``asynclock`` command."""

from . import main

raise SystemExit(main())
