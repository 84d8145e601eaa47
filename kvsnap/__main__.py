from kvsnap.commands.cli import main

raise SystemExit(main())
