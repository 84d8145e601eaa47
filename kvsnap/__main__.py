from kvsnap.cli import main

raise SystemExit(main())
