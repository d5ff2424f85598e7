# First, before the imports that take seconds: a child of `specwire up` / `bench` whose parent
# is already gone stops now, not once torch has loaded.
from specwire.lifeline import watch_parent

watch_parent()

from specwire.client.cli import main  # noqa: E402

raise SystemExit(main())
