"""`python -m nebula_rl.cli`: the `nebula-rl` command."""

from nebula_rl.cli.main import main

raise SystemExit(main())
